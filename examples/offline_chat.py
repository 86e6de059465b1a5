"""Offline chat with the embedded SmolLM2-135M-Instruct: the same script runs on vLLM
after `s/pagedllm/vllm/` (and a model name)."""
from pagedllm import LLM, SamplingParams

llm = LLM(max_model_len=4096)  # no model given: the embedded SmolLM2 GGUF
params = SamplingParams(temperature=0, max_tokens=128)
conversations = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about paged memory."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
for conv, out in zip(conversations, llm.chat(conversations, params)):
    print(f"\n>>> {conv[-1]['content']}\n{out.outputs[0].text.strip()}")
