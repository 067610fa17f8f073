"""vLLM's OpenAI server as the tests start it: ``python -m tests.integrations.vllm.serve <vLLM's arguments>``
runs the main of ``python -m vllm.entrypoints.openai.api_server`` with vLLM's Triton code paths under
Triton's interpreter (`triton_interpreter`). The engine core and the TP workers are spawned and re-run
this entry module, so the interpreter's backend is registered in each before vLLM is imported; under
`deepseek_v4_on_cpu.ENV` each also takes that module's DeepSeek-V4 shims."""

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM is imported)
import tests.integrations.vllm.deepseek_v4_on_cpu  # noqa: F401, I001  (applied where its ENV is set)

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
