"""An offline-inference script as a vLLM user writes it; only the import line differs from vLLM's.

Run by tests/test_vllm_script.py against the embedded default model. The hub id names the model as
it would in vLLM; jaxrunner serves its embedded copy and downloads nothing.
"""
from jaxrunner import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams


def main():
    # float32 pinned: "auto" is bfloat16 on CPUs with bf16 dot products, where greedy text differs
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32", max_model_len=1024,
              gpu_memory_utilization=0.5, max_num_seqs=8, max_num_batched_tokens=128, seed=0)

    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is", "Count: one, two, three,"]
    sampling_params = [
        SamplingParams(temperature=0.0, max_tokens=16),
        SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=16),
        SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=32, stop=[" five"], include_stop_str_in_output=True),
    ]
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        for completion in output.outputs:
            print(f"Prompt: {output.prompt!r}, Generated text: {completion.text!r}, "
                  f"finish_reason: {completion.finish_reason}, samples: {len(output.outputs)}")

    output = llm.generate("The capital of France is",
                          SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=1))[0]
    for token_id, logprobs in zip(output.outputs[0].token_ids, output.outputs[0].logprobs):
        chosen = logprobs[token_id]
        print(f"Token: {chosen.decoded_token!r}, logprob: {chosen.logprob:.3f}, rank: {chosen.rank}, "
              f"alternatives: {len(logprobs)}")
    print(f"Prompt logprobs: {len(output.prompt_logprobs)} positions, first: {output.prompt_logprobs[0]}")

    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "What is the capital of France?"}]
    chat = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=24))
    print(f"Chat: {chat[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
