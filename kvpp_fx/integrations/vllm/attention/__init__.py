"""What KVPP changes in the model's attention: the hooks on the loaded model (`model_hooks`), owner rows
(`owner_rows`, over the MLA backends' owner calls in `backends`), each layer's packed metadata
(`packed_metadata`), prefill history streamed from the owners (`context_stream`) and the compiled paths
(`compilation`). Imports nothing: the plugin must stay cheap in every vLLM process."""
