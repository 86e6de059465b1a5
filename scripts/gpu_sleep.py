"""Sleep mode on the GPU: device memory in use (torch.cuda.mem_get_info, MiB) and the time of
each call, for the llama3-8b shape with dummy weights:

    awake -> sleep(1) -> wake_up() -> sleep(2) -> wake_up() + update_weights

The update after sleep(2) puts back the model's own weights, saved to host memory before in the
Hugging Face checkpoint's names (fused q/k/v and gate/up split again), so it goes through the
same path a trainer's state_dict takes. Greedy tokens must be the same before and after
sleep(1)/wake_up and after sleep(2)/wake_up/update (the weights woken from level 2 are first
filled with NaN, so only the update can bring the tokens back). Exit code 0 when they are.

    python scripts/gpu_sleep.py [--shape llama3-8b] [--gpu-memory-utilization 0.9]
    python scripts/gpu_sleep.py --cpu-smoke      # the same sequence on CPU, tiny shape, no memory figures
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.benchmarks.common import device_name, emit, git_commit, print_table, write_shape


def used_mib() -> float | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**20, 1)


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 3)


def hf_named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Our parameters as a HF checkpoint names them (fused q/k/v and gate/up split), on the host."""
    modules = dict(model.named_modules())
    out = []
    for name, param in model.named_parameters():  # a tied lm_head appears once, as the embedding
        splits = [(part, fused, shard) for part, (fused, shard) in model.stacked_params.items() if fused in name]
        if not splits:
            out.append((name, param.data.to("cpu", copy=True)))
        for part, fused, shard in splits:
            offset, size = modules[name.rsplit(".", 1)[0]]._shard_range(shard)
            out.append((name.replace(fused, part), param.data.narrow(0, offset, size).to("cpu", copy=True)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="default: llama3-8b (tiny-llama with --cpu-smoke)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--cpu-smoke", action="store_true", help="run the sequence on CPU (no memory figures)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("gpu_sleep.py needs a CUDA device and none is available (--cpu-smoke runs the same sequence on CPU)",
              file=sys.stderr)
        return 2
    shape = args.shape or ("tiny-llama" if args.cpu_smoke else "llama3-8b")
    engine_kwargs = dict(load_format="dummy", enable_sleep_mode=True, skip_tokenizer_init=True,
                         max_model_len=args.max_model_len, max_num_seqs=64)
    if args.cpu_smoke:
        engine_kwargs.update(device="cpu", kv_cache_memory_bytes=256 << 20)
    else:
        engine_kwargs.update(gpu_memory_utilization=args.gpu_memory_utilization)

    rows: list[dict] = [{"stage": "before LLM()", "used_mib": used_mib()}]
    t0 = time.perf_counter()
    llm = LLM(write_shape(shape), **engine_kwargs)
    rows.append({"stage": "awake", "used_mib": used_mib(), "call_s": round(time.perf_counter() - t0, 3)})
    worker = llm.llm_engine.engine_core.executor.worker
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(n)]) for n in (7, 64, 200, 31)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False)

    def greedy() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    before = greedy()
    steps = [
        ("sleep(1)", lambda: llm.sleep(1)),
        ("wake_up()", lambda: llm.wake_up()),
        ("check", None),
        ("save weights (HF names, host)", None),
        ("sleep(2)", lambda: llm.sleep(2)),
        ("wake_up() (level 2)", lambda: llm.wake_up()),
        ("update_weights", None),
        ("check", None),
    ]
    saved: list = []
    checks = []
    for stage, call in steps:
        if stage == "check":
            same = greedy() == before
            checks.append(same)
            rows.append({"stage": "greedy == before", "used_mib": used_mib(), "same_tokens": same})
            continue
        if stage.startswith("save"):
            call_s = timed(lambda: saved.extend(hf_named_weights(worker.model_runner.model)))
        elif stage == "wake_up() (level 2)":
            call_s = timed(call)
            with torch.no_grad():  # level 2's weights are undefined: make sure only the update restores them
                for param in worker.model_runner.model.parameters():
                    param.data.fill_(float("nan"))
        elif stage == "update_weights":
            call_s = timed(lambda: llm.update_weights(saved))
            saved.clear()
        else:
            call_s = timed(call)
        rows.append({"stage": f"after {stage}", "used_mib": used_mib(), "call_s": call_s})

    print(f"# {device_name()}, shape {shape}, commit {git_commit()}, KV cache "
          f"{llm.llm_engine.engine_core.kv_cache_manager.num_blocks} blocks")
    print_table(rows, ["stage", "used_mib", "call_s", "same_tokens"])
    emit({"bench": "gpu_sleep", "shape": shape, "rows": rows})
    ok = all(checks)
    print("OK: greedy tokens identical after sleep(1)/wake_up and sleep(2)/wake_up/update" if ok else
          "FAIL: greedy tokens changed across sleep/wake")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
