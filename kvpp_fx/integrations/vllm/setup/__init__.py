"""What the plugin checks and sets at ``LLM(...)``: the KVPP configuration and deployment rules
(`config`), the platform, release and runner checks (`validation`) and the compilation mode's settings
(`compile_modes`). Imports nothing: the plugin loads `config` in every vLLM process."""
