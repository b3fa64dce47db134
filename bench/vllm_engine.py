"""The vLLM rollout engine (``areal_bus.engines.vllm_engine.VllmRolloutEngine``) on one GPU: decode speed,
its recorded logprobs against the trainer's recompute, a weight swap over CUDA IPC in the middle of
running requests, and prefill per turn of a multi-turn agent with and without prefix caching.

Run by ``bench/engine.py --vllm`` in a process of its own (vLLM's engine core runs in-process here, see
the engine's docstring, and a process is the unit vLLM frees GPU memory by), on the checkpoint folder and
prompts that script wrote, so the vLLM rows sit beside the torch engine's in the same run:

  rows     for each batch: one warm-up run (other prompts, so no prefix hit flatters the timed run), then
           the timed run of the same prompts the torch engine got: temperature 1, top_p 1, exactly
           ``--new`` tokens each (no stop token), the sampled token's logprob recorded. tokens/s = batch x
           new / wall time from the first add_request to the last completion, prefill included.
  logprobs 8 prompts at temperature 1; |recorded - modeling.token_logprobs of prompt + output| (bf16).
  swap     a publisher process (the trainer's side: ``weights_cuda.CudaWeightWriter``) writes versions
           1 and 2 of the weights (the checkpoint plus noise) into its CUDA buffers; vLLM's worker opens
           the handles once; each version is swapped in (``swap_weights``: ``collective_rpc`` ->
           ``load_weights``) while 64 requests are mid-generation. Reported: swap ms (the RPC, copies
           included) and publish-to-serving ms (from the publisher starting its write to the first step
           after the swap returning tokens tagged with the new version); the tags are checked.
  prefix   a 5-turn agent: ``--agents`` conversations; turn 1 is a 128-token prompt, each later turn's
           prompt is the whole conversation so far (earlier prompts and outputs, token for token) plus
           32 new user tokens; 64 new tokens per turn. Prefill tokens per turn (prompt tokens minus vLLM's
           ``num_cached_tokens``) and turn wall time, with prefix caching and without: the same engine
           with every request given a salt of its own, so no request can hit (same memory, same run).

Prints one ``VLLM_JSON {...}`` line that bench/engine.py reads.

Run alone:  python3 bench/vllm_engine.py --model DIR --prompts prompts.npz [--swap] [--prefix]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

from areal_bus.wire.messages import GenerateRequest  # noqa: E402

LOGPROB_BATCH = 8
SWAP_BATCH = 64
SWAP_AT_STEP = 20


def request(rid: str, prompt, new: int, temperature: float = 1.0) -> GenerateRequest:
    return GenerateRequest(request_id=rid, episode_id=rid, ticket=0, min_version=0, max_tokens=new,
                           temperature=temperature, prompt_ids=np.asarray(prompt, dtype=np.int32))


def generate(engine, reqs: list[GenerateRequest], between=None) -> tuple[float, dict]:
    """Seconds from the first add_request to the last completion, and the completions by id;
    ``between(step)`` runs before each step."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    out, step = {}, 0
    while len(out) < len(reqs):
        if between is not None:
            between(step)
        out |= {c.request_id: c for c in engine.step()}
        step += 1
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def rows(engine, prompts: dict[int, np.ndarray], new: int, vocab: int) -> dict:
    result = {}
    for batch, p in prompts.items():
        warm_prompts = (p + 1) % vocab
        cold, _ = generate(engine, [request(f"w{batch}-{i}", x, new) for i, x in enumerate(warm_prompts)])
        secs, out = generate(engine, [request(f"t{batch}-{i}", x, new) for i, x in enumerate(p)])
        assert all(c.output_ids.size == new for c in out.values()), "a request stopped early"
        result[batch] = {"tok_s": batch * new / secs, "warm_s": secs, "cold_s": cold}
        print(f"vllm batch {batch}: {batch * new / secs:.0f} tok/s ({secs:.2f} s; warm-up {cold:.2f} s)", flush=True)
    return result


def logprob_gap(engine, model_dir: str, prompts: np.ndarray, new: int) -> dict:
    from areal_bus.model.modeling import load_pretrained, token_logprobs

    _, out = generate(engine, [request(f"lp{i}", p, new) for i, p in enumerate(prompts)])
    model = load_pretrained(model_dir, "cuda", torch.bfloat16)
    ids = torch.tensor(np.stack([np.concatenate([p, out[f"lp{i}"].output_ids]) for i, p in enumerate(prompts)]),
                       device="cuda", dtype=torch.long)
    recorded = torch.from_numpy(np.stack([out[f"lp{i}"].logprobs for i in range(len(prompts))])).cuda()
    with torch.inference_mode():
        ours = token_logprobs(model, ids, temperature=1.0)[:, prompts.shape[1]:].float()
    gap = (recorded - ours).abs()
    del model
    torch.cuda.empty_cache()
    return {"max": gap.max().item(), "mean": gap.mean().item()}


# -- the swap -----------------------------------------------------------------------------------------


def publisher(model_dir: str, conn) -> None:
    """The trainer's side, in a process of its own: the checkpoint's weights plus noise as versions
    1 and 2 in CUDA buffers; handles, then each location with the wall time its write began."""
    from areal_bus.model.modeling import load_safetensors
    from areal_bus.weights.cuda import CudaWeightWriter

    sd = {k: v.to(torch.bfloat16) for k, v in load_safetensors(model_dir, "cuda").items()}
    writer = CudaWeightWriter("vllmbench", {k: v.to("meta") for k, v in sd.items()}, device="cuda")
    conn.send(writer.handles())
    for version in (1, 2):
        state = {k: v + 0.01 * torch.randn_like(v) for k, v in sd.items()}
        torch.cuda.synchronize()
        assert conn.recv() == "next"
        t_publish = time.time()
        location = writer.write(state, version)
        conn.send((location, t_publish))
    conn.recv()  # "done": keep the buffers alive until the reader has copied them


def swap(engine, model_dir: str, prompts: np.ndarray, new: int) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=publisher, args=(model_dir, there), daemon=True)
    proc.start()
    try:
        engine.attach_weights({"kind": "cuda", "handles": here.recv()})
        out = {}
        for version in (1, 2):
            state = {}

            def between(step, version=version, state=state):
                if step == SWAP_AT_STEP:
                    here.send("next")
                    location, t_publish = here.recv()
                    state["swap_s"] = engine.swap_weights(version, location)
                    state["t_publish"] = t_publish
                    state["armed"] = True  # the next step's tokens are the first of the new version

            reqs = [request(f"s{version}-{i}", p, new) for i, p in enumerate(prompts)]
            orig_step = engine.step

            def step_and_time(state=state):
                got = orig_step()
                if state.pop("armed", False):
                    torch.cuda.synchronize()
                    state["t_first"] = time.time()
                return got

            engine.step = step_and_time
            try:
                _, done = generate(engine, reqs, between)
            finally:
                engine.step = orig_step
            tags = [c.versions.tolist() for c in done.values()]
            # every request was running at the swap: its first tokens carry the old version, then only
            # the new one (how many came before depends on how vLLM's scheduler split the prefills)
            ok = all(t[0] == version - 1 and t[-1] == version and t == sorted(t) for t in tags)
            out[version] = {"swap_ms": 1e3 * state["swap_s"],
                            "publish_to_serving_ms": 1e3 * (state["t_first"] - state["t_publish"]), "tags_ok": ok}
            print(f"swap to v{version}: {out[version]}", flush=True)
        here.send("done")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return out


# -- prefix caching -----------------------------------------------------------------------------------


def prefix(engine, agents: int, vocab: int, turns: int = 5, first: int = 128, user: int = 32, reply: int = 64) -> dict:
    rng = np.random.default_rng(7)
    result = {}
    for mode in ("cache", "no_cache"):
        history = [rng.integers(0, vocab, first).astype(np.int32) for _ in range(agents)]
        per_turn = []
        for turn in range(turns):
            if turn:
                history = [np.concatenate([h, rng.integers(0, vocab, user).astype(np.int32)]) for h in history]
            before = (engine.prefill.prompt_tokens, engine.prefill.cached_tokens)
            t0 = time.perf_counter()
            for i, h in enumerate(history):
                if mode == "no_cache":  # a salt of its own: nothing this request could hit
                    engine.weights_loaded += 1
                engine.add_request(request(f"{mode}{turn}-{i}", h, reply))
            out = {}
            while len(out) < agents:
                out |= {c.request_id: c for c in engine.step()}
            secs = time.perf_counter() - t0
            history = [np.concatenate([h, out[f"{mode}{turn}-{i}"].output_ids.astype(np.int32)])
                       for i, h in enumerate(history)]
            prompt_tokens = engine.prefill.prompt_tokens - before[0]
            cached = engine.prefill.cached_tokens - before[1]
            per_turn.append({"prompt_tokens": prompt_tokens // agents, "prefilled": (prompt_tokens - cached) // agents,
                             "turn_s": secs})
        result[mode] = per_turn
        print(f"prefix {mode}: {per_turn}", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors)")
    ap.add_argument("--prompts", required=True, help=".npz of prompts: b<batch> arrays, and 'logprob'")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--swap", action="store_true")
    ap.add_argument("--prefix", action="store_true")
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    args = ap.parse_args()
    from areal_bus.engines.vllm_engine import VllmRolloutEngine
    from areal_bus.model.modeling import ModelConfig

    data = np.load(args.prompts)
    prompts = {int(k[1:]): data[k] for k in data.files if k.startswith("b")}
    vocab = ModelConfig.from_hf(args.model).vocab_size
    longest = max(data[k].shape[1] for k in data.files) + args.new
    if args.prefix:
        longest = max(longest, 128 + 4 * 32 + 5 * 64)
    max_len = -(-(longest + 1) // 128) * 128
    t0 = time.perf_counter()
    engine = VllmRolloutEngine(args.model, max_batch=max(max(prompts), SWAP_BATCH, args.agents), max_len=max_len,
                               dtype="bfloat16", eos_token_ids=[], gpu_memory_utilization=args.gpu_memory_utilization,
                               skip_tokenizer_init=True)
    import vllm

    result = {"vllm": vllm.__version__, "start_s": time.perf_counter() - t0}
    print(f"vLLM {vllm.__version__} engine up in {result['start_s']:.0f} s", flush=True)
    result["rows"] = rows(engine, prompts, args.new, vocab)
    result["logprob"] = logprob_gap(engine, args.model, data["logprob"], args.new)
    print(f"vllm logprobs: {result['logprob']}", flush=True)
    if args.swap:
        result["swap"] = swap(engine, args.model, prompts[min(prompts)][:SWAP_BATCH], min(args.new, 128))
    if args.prefix:
        result["prefix"] = prefix(engine, args.agents, vocab)
    print("VLLM_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
