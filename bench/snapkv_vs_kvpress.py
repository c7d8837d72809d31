"""Decode-time SnapKV: kvflow's `snapkv` evictor against kvpress's `DecodingPress(SnapKVPress)`
(issue 7, performance side by side with a peer).

Both sides load the same bf16 safetensors copy of a catalog model (`kvflow models pull` makes
it: `~/.cache/kvflow/models/<name>/hf-bfloat16/`), decode the same prompt token ids greedily at
batch 1 (kvpress's decoding compression supports one sequence) for the same number of tokens,
and each runs in its own process, so that max RSS is that side's alone:

- kvflow (this repository's .venv): `HFRunner` with the `snapkv` evictor, `budget` B,
  `buffer` I, `window` W, `gqa: mean`, `softmax_keys: causal`, `pooling: avg`, `kernel: 5`
  (the SnapKV variant kvpress's SnapKVPress computes); kvflow compacts a row when it holds
  B + I tokens, down to exactly B per (layer, KV head), the last W among them.
- kvpress (bench/kvpress/.venv, made by bench/kvpress/setup.sh: kvpress 0.5.5 needs
  transformers < 5.3): `DecodingPress(base_press=SnapKVPress(window_size=W, kernel_size=5),
  compression_interval=I, target_size=B, hidden_states_buffer_size=I)` on a `DynamicCache`,
  decoded with the loop of kvpress's own pipeline (`model(...)` with explicit position ids;
  the prompt but its last token prefilled without the press, as the pipeline prefills its
  context). kvpress compresses every I decode steps to exactly B tokens (all heads alike).

With a prompt of B + 1 tokens the two compress at the same steps (every I tokens, from
B + I to B). Each side also runs the same decode without compression (kvflow `none`,
kvpress without a press) in lockstep with the compressed one (one step of each in turn, so
the load of a shared machine hits both alike), and each framework's compression cost is read
against its own loop; compaction time is measured on both sides (kvflow's
`BudgetedCache.compact`, kvpress's `DecodingPress.compress`). The processes run one after
the other (`--order`, by default kvflow, kvpress, kvflow to bracket the drift). Memory:
RSS after loading, the peak RSS while decoding (the kernel's mark reset after loading;
loading itself peaks far higher) and the KV bytes each cache holds.

    python bench/snapkv_vs_kvpress.py --budget 128 --interval 64 --window 32 --tokens 256 --threads 1
    python bench/snapkv_vs_kvpress.py --model smollm2-135m-instruct --tokens 48 --budget 32 --interval 16 --window 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from _common import machine_line  # noqa: E402 - bench/ is on sys.path

HERE = Path(__file__).resolve().parent
KVPRESS_PYTHON = HERE / "kvpress" / ".venv" / "bin" / "python"
TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Let's think step by step. "
    "In May she sold 48 / 2 = 24 clips. Altogether she sold 48 + 24 = 72 clips. "
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn? Weng earns 12 / 60 = $0.2 per minute. Working 50 minutes, she earned "
    "0.2 x 50 = $10. Betty is saving money for a new wallet which costs $100. Betty has only half of "
    "the money she needs. Her parents decided to give her $15 for that purpose, and her grandparents "
    "twice as much as her parents. How much more money does Betty need to buy the wallet? "
    "Julie is reading a 120-page book. Yesterday, she was able to read 12 pages and today, she read "
    "twice as many pages as yesterday. If she wants to read half of the remaining pages tomorrow, "
    "how many pages should she read? James writes a 3-page letter to 2 different friends twice a week. "
    "How many pages does he write a year? Mark has a garden with flowers. He planted plants of three "
    "different colors in it. Ten of them are yellow, and there are 80% more of those in purple. "
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=["both", "kvflow", "kvpress"], default="both")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="catalog name (its hf-bfloat16 copy)")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--interval", type=int, default=64, help="kvflow buffer = kvpress compression_interval")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--kernel", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256, help="new tokens (decode steps)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default: budget + 1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="none,snapkv", help="what each side runs (in lockstep, one step of each in turn)")
    ap.add_argument("--order", default="kvflow,kvpress,kvflow",
                    help="processes to run, in order (a side named twice runs twice, to bracket the other)")
    ap.add_argument("--ids", default=None, help="(child) JSON file with the prompt ids")
    ap.add_argument("--out", default=None, help="(child) write results here; (both) all results as JSON")
    return ap.parse_args(argv)


def model_dir(name: str) -> Path:
    root = os.environ.get("KVFLOW_CACHE") or (Path(os.environ["XDG_CACHE_HOME"]) / "kvflow"
                                               if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache" / "kvflow")
    d = Path(root) / "models" / name / "hf-bfloat16"
    if not (d / "model.safetensors").is_file():
        sys.exit(f"{d} has no model.safetensors: run `kvflow models pull {name}` and load it once in bfloat16")
    return d


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process, so that `peak_rss_mib()`
    covers only what follows (model loading peaks far above the steady state)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# --------------------------------------------------------------------------- kvflow side


def side_kvflow(args, ids):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvflow.backends.hf.engine import HFRunner
    from kvflow.registry import get_registry

    torch.set_num_threads(args.threads)
    d = model_dir(args.model)
    runner = HFRunner(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval(), AutoTokenizer.from_pretrained(d))
    reg = get_registry()
    results = {"versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
               "rss_loaded_mib": rss_mib(), "runs": {}}
    runs = {}
    for mode in args.modes.split(","):
        if mode == "none":
            cls = reg.get("evictors", "none")
            ev = cls(cls.Params())
        else:
            cls = reg.get("evictors", "snapkv")
            ev = cls(cls.Params(budget=args.budget, buffer=args.interval, window=args.window, kernel=args.kernel,
                                gqa="mean", softmax_keys="causal", pooling="avg"))
        cache = runner.new_cache(ev, 1)
        comp = {"n": 0, "s": 0.0}
        cache.compact = _timed(cache.compact, comp)
        runs[mode] = dict(ev=ev, cache=cache, comp=comp, out=[], decode_s=0.0, state=0)
    reset_peak_rss()
    with torch.inference_mode():
        for run in runs.values():
            t = time.perf_counter()
            run["pending"] = runner.prefill(run["cache"], [ids])
            run["prefill_s"] = time.perf_counter() - t
        for _ in range(args.tokens):  # lockstep: one step of each mode in turn
            for run in runs.values():
                t = time.perf_counter()
                run["pending"] = runner.forward(run["cache"], run["pending"][:, None]).argmax(-1)
                run["decode_s"] += time.perf_counter() - t
                run["out"].append(int(run["pending"][0]))
                run["state"] = max(run["state"], _query_bytes(run["cache"]))
    per_token = _kv_bytes_per_token(runner.model)
    for mode, run in runs.items():
        ev, cache = run["ev"], run["cache"]
        peak = _peak_tokens(ev, len(ids), args.tokens)
        results["runs"][mode] = _summary(args, run["prefill_s"], run["decode_s"], run["out"], run["comp"],
                                         int(cache.rows.lengths[0]), peak, peak * per_token, cache.resident_bytes(),
                                         run["state"])
    results["peak_rss_decode_mib"] = peak_rss_mib()
    return results


def _timed(fn, acc):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc["n"] += 1
            acc["s"] += time.perf_counter() - t
    return wrapper


def _summary(args, prefill_s, decode_s, out, comp, final, peak_tokens, peak_kv, allocated, state) -> dict:
    r = {"prefill_s": prefill_s, "decode_s": decode_s, "tok_per_s": args.tokens / decode_s, "tokens": out,
         "compactions": comp["n"], "compaction_s": comp["s"],
         "tok_per_s_without_compaction": args.tokens / (decode_s - comp["s"]),
         "final_resident_tokens": final, "peak_resident_tokens": peak_tokens, "kv_bytes_peak_resident": peak_kv,
         "kv_bytes_allocated": allocated, "evictor_state_bytes": state}
    print(f"  decode {decode_s:.2f} s ({r['tok_per_s']:.2f} tok/s), {comp['n']} compactions, {comp['s']:.2f} s",
          file=sys.stderr)
    return r


def _query_bytes(cache) -> int:
    return sum(l.queries.numel() * l.queries.element_size() for l in cache.layers if l.queries is not None)


def _kv_bytes_per_token(model) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 2  # keys + values, bf16


def _peak_tokens(ev, prompt_len, tokens) -> int:
    """Most tokens a forward attended over: prompt - 1 prefilled, then one per decode step;
    a bounded cache never holds more than budget + buffer."""
    total = prompt_len - 1 + tokens
    return min(total, ev.trigger) if ev.bounded else total


# --------------------------------------------------------------------------- kvpress side


def side_kvpress(args, ids):
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import kvpress
    import transformers
    from kvpress import DecodingPress, SnapKVPress

    class GatedDecodingPress(DecodingPress):
        """DecodingPress whose hooks act only while `enabled` (the uncompressed run of the
        lockstep decodes through the same model between the compressed run's steps)."""

        enabled = True

        def forward_hook(self, module, input, kwargs, output):
            return super().forward_hook(module, input, kwargs, output) if self.enabled else output

    torch.set_num_threads(args.threads)
    d = model_dir(args.model)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    results = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress")},
               "rss_loaded_mib": rss_mib(), "runs": {}}
    press = GatedDecodingPress(base_press=SnapKVPress(window_size=args.window, kernel_size=args.kernel),
                               compression_interval=args.interval, target_size=args.budget,
                               hidden_states_buffer_size=args.interval)
    comp = {"n": 0, "s": 0.0}
    press.compress = _timed(press.compress, comp)  # one call per layer and compression
    runs = {mode: dict(cache=DynamicCache(), out=[], decode_s=0.0, peak=0, hidden=0, comp={"n": 0, "s": 0.0})
            for mode in args.modes.split(",")}
    input_ids = torch.tensor([ids])
    reset_peak_rss()
    with torch.inference_mode():
        for run in runs.values():
            t = time.perf_counter()
            # as kvpress's pipeline: the context prefilled by the body without the press
            model.model(input_ids=input_ids[:, :-1], past_key_values=run["cache"])
            run["prefill_s"] = time.perf_counter() - t
            run["token"] = input_ids[:, -1:]
        with press(model):
            for i in range(args.tokens):
                for mode, run in runs.items():
                    press.enabled = mode != "none"
                    cache = run["cache"]
                    before = cache.get_seq_length()
                    n0, s0 = comp["n"], comp["s"]
                    t = time.perf_counter()
                    logits = model(input_ids=run["token"], past_key_values=cache,
                                   position_ids=torch.tensor([[len(ids) - 1 + i]])).logits
                    run["token"] = logits[:, -1].argmax(-1, keepdim=True)
                    run["decode_s"] += time.perf_counter() - t
                    run["out"].append(int(run["token"][0, 0]))
                    run["peak"] = max(run["peak"], before + 1)  # the forward attended over before + 1 tokens
                    if comp["n"] > n0:
                        run["comp"]["n"] += 1
                        run["comp"]["s"] += comp["s"] - s0
                    if press.enabled:
                        run["hidden"] = max(run["hidden"], sum(sum(h.numel() * h.element_size() for h in hs)
                                                               for hs in press.hidden_states_buffer.values()))
    for mode, run in runs.items():
        cache = run["cache"]
        per_token = sum(l.keys.shape[1] * l.keys.shape[3] * 2 * l.keys.element_size() for l in cache.layers)
        allocated = sum((l.keys.numel() + l.values.numel()) * l.keys.element_size() for l in cache.layers)
        results["runs"][mode] = _summary(args, run["prefill_s"], run["decode_s"], run["out"], run["comp"],
                                         cache.get_seq_length(), run["peak"], run["peak"] * per_token, allocated,
                                         run["hidden"])
    results["peak_rss_decode_mib"] = peak_rss_mib()
    return results


def _dist_version(name):
    import importlib.metadata

    return importlib.metadata.version(name)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------- driver


def make_ids(args) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir(args.model) / "tokenizer.json"))
    n = args.prompt_tokens or args.budget + 1
    ids = tok.encode(TEXT * (1 + n // 100), add_special_tokens=False).ids
    assert len(ids) >= n, "prompt text too short"
    return ids[:n]


def child(args):
    ids = json.loads(Path(args.ids).read_text())
    res = side_kvflow(args, ids) if args.side == "kvflow" else side_kvpress(args, ids)
    res["max_rss_mib"] = max_rss_mib()
    Path(args.out).write_text(json.dumps(res))


def both(args, argv):
    if not KVPRESS_PYTHON.exists():
        sys.exit(f"{KVPRESS_PYTHON} missing: run `bash bench/kvpress/setup.sh` first")
    ids = make_ids(args)
    meta = {"command": " ".join(["python", "bench/snapkv_vs_kvpress.py"] + list(argv if argv is not None else sys.argv[1:])),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_line(),
            "cpus": os.cpu_count(), "load_before": os.getloadavg(), "prompt_tokens": len(ids)}
    print(f"# SnapKV kvflow vs kvpress: {args.model}, prompt {len(ids)} tokens, {args.tokens} new, budget "
          f"{args.budget}, interval {args.interval}, window {args.window}, {args.threads} thread(s), "
          f"load {meta['load_before']}", file=sys.stderr)
    sides = []
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
        for k, side in enumerate(args.order.split(",")):
            python = sys.executable if side == "kvflow" else str(KVPRESS_PYTHON)
            print(f"  {side} process ({k + 1})", file=sys.stderr)
            out = Path(tmp) / f"{side}{k}.json"
            cmd = [python, str(Path(__file__).resolve()), *passthrough, "--side", side, "--ids", str(ids_file),
                   "--out", str(out)]
            env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1",
                       TQDM_DISABLE="1")
            subprocess.run(cmd, check=True, env=env)
            sides.append((f"{side} ({k + 1})", json.loads(out.read_text())))
    meta["load_after"] = os.getloadavg()
    report(args, meta, sides)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "sides": dict(sides)}, indent=2))


def agree(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(args, meta, sides):
    for name, side in sides:
        print(f"versions of {name}: {side['versions']}")
    print(f"\n| process | mode | decode tok/s | vs own none | compactions | ms / compaction | tok/s without compaction "
          f"| resident tokens after | peak resident tokens | peak KV (MiB) | KV allocated after (MiB) "
          f"| evictor state (KiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, side in sides:
        base = side["runs"].get("none")
        for mode, r in side["runs"].items():
            rel = f"{r['tok_per_s'] / base['tok_per_s']:.3f}" if base else "-"
            per = f"{r['compaction_s'] / r['compactions'] * 1e3:.0f}" if r["compactions"] else "-"
            print(f"| {name} | {mode} | {r['tok_per_s']:.2f} | {rel} | {r['compactions']} | {per} "
                  f"| {r['tok_per_s_without_compaction']:.2f} | {r['final_resident_tokens']} "
                  f"| {r['peak_resident_tokens']} | {r['kv_bytes_peak_resident'] / 2**20:.2f} "
                  f"| {r['kv_bytes_allocated'] / 2**20:.2f} | {r['evictor_state_bytes'] / 1024:.0f} |")
    print("\n| process | RSS after loading (MiB) | peak RSS while decoding (MiB) | max RSS incl. loading (MiB) |")
    print("|---|---|---|---|")
    for name, side in sides:
        print(f"| {name} | {side['rss_loaded_mib']:.0f} | {side['peak_rss_decode_mib']:.0f} | {side['max_rss_mib']:.0f} |")
    kvf = [s for n, s in sides if n.startswith("kvflow")]
    kvp = [s for n, s in sides if n.startswith("kvpress")]
    if kvf and kvp:
        for mode in kvf[0]["runs"]:
            if mode in kvp[0]["runs"]:
                a = sum(s["runs"][mode]["tok_per_s"] for s in kvf) / len(kvf)
                b = sum(s["runs"][mode]["tok_per_s"] for s in kvp) / len(kvp)
                print(f"\n{mode}: kvflow / kvpress decode throughput {a / b:.3f} (means over processes); greedy tokens "
                      f"agree for the first {agree(kvf[0]['runs'][mode]['tokens'], kvp[0]['runs'][mode]['tokens'])} "
                      f"of {args.tokens}")
    print(f"\nload before/after: {meta['load_before']} / {meta['load_after']}")


def main(argv=None):
    args = parse_args(argv)
    if args.side == "both":
        both(args, argv)
    else:
        child(args)


if __name__ == "__main__":
    main()
