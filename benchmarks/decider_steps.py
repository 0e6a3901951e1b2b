"""Where the tool decider's time goes: one call decision (and one spoken answer) on the thinker, three ways, side by side.

The default tool decider (``duplexkit.agent.decider.EngineToolDecider``) runs the thinker in its
turn-based text mode (``duplexkit.models.minicpmo45.chat.chat_steps``) with the call grammar. This
script runs that generation directly on the thinker, for the same conversation (a system message
and the user's turn as audio: ``tests/fixtures/audio/question_16k.wav``) and the same tool as
``benchmarks/tools_latency.py`` (``get_weather``, ``tool_choice: "required"``), three ways:

* ``token-by-token``: the chat KV in a ``DynamicCache`` and one eager Hugging Face forward per
  generated token, every forced token of the call's JSON decoded one at a time (before 2026-12-08);
* ``jump-forward``: the same KV, the grammar's forced tokens (llguidance fast-forward tokens) fed in
  one forward pass per run of them;
* ``graphs + jump-forward`` (the default): the KV in a free slot of the batched thinker's pool, so
  each one-token step is the fast thinker's captured CUDA graph (the default on CUDA; on the CPU
  the pool's eager decoder, slower there than the ``DynamicCache``, which the default keeps).

and the answer to the tool's output (``tool_choice: "none"``, ``--answer-tokens`` tokens, no
grammar) token by token vs in the pool's slot; then ``--together`` N call decisions at once (N
sessions ending their turns together) one after another vs stepped together, one batched decode
step for all (``step_replies``; the engine runs concurrent replies so). Per way it prints p50 of (ms): the whole
generation, the prompt's prefill, the decode (grammar work included), and the decode steps,
forced tokens / passes and ms per decode step (``ChatThinkerResult.stats``).

Examples::

    python benchmarks/decider_steps.py --model tiny --device cpu --repeats 3
    python benchmarks/decider_steps.py --model random-real --device cuda --tokenizer-dir .tok --repeats 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _cli import positive_int  # noqa: E402
from tools_latency import OUTPUT, TOOL  # noqa: E402

WAYS = (("token-by-token", False, False), ("jump-forward", True, False), ("graphs + jump-forward", True, True))
SYSTEM = "You are a helpful voice assistant. Use the tools when they help."


def build(a):
    """The model (thinker only) on ``a.device``: the tiny checkpoint or random weights at real size,
    its thinker's KV pool with a slot for each of ``--together`` replies."""
    import torch

    if a.model == "tiny":
        import tempfile

        from duplexkit.models.minicpmo45 import build_tiny_checkpoint, load

        d = build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="decider-steps-")) / "ckpt", seed=0)
        return load(d, progress=False, with_code2wav=False, fast=True, devices=a.device,
                    fast_options={"thinker": {"slots": a.together + 1}})
    from duplexkit.models.minicpmo45.random_init import build_random_model

    return build_random_model("real", dtype=torch.bfloat16, device=a.device, with_code2wav=False, fast=True,
                              tokenizer_dir=a.tokenizer_dir, thinker_max_len=4096, kv_slots=a.together + 1)


def conversation():
    """(call messages, answer messages): the user's turn as 16 kHz audio, then the call and its output
    in the text form the session gives the decider (``duplexkit.session.tools.decider_messages``)."""
    import soundfile as sf

    audio, sr = sf.read(BENCH.parent / "tests" / "fixtures" / "audio" / "question_16k.wav", dtype="float32")
    assert sr == 16000, sr
    call = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [audio]}]
    args = json.dumps({"city": "Paris", "unit": "celsius"})
    answer = call + [
        {"role": "assistant", "content": f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'},
        {"role": "user", "content": f"<tool_response>\n{OUTPUT}\n</tool_response>"},
    ]
    return call, answer


def run_way(th, messages, *, tools, choice, max_tokens, jump_forward, static_kv, repeats):
    rows = []
    for _ in range(repeats + 1):  # the first run warms caches and graphs: not counted
        t0 = time.perf_counter()
        r = th.chat(messages, tools=tools, tool_choice=choice, temperature=0.0, max_tokens=max_tokens,
                    jump_forward=jump_forward, static_kv=static_kv)
        ms = (time.perf_counter() - t0) * 1000.0
        rows.append((ms, r))
    rows = rows[1:]
    st = [r.stats for _, r in rows]
    steps = [s["decode_steps"] for s in st]
    p50 = lambda v: float(np.percentile(v, 50))  # noqa: E731
    return {
        "total_ms": p50([ms for ms, _ in rows]),
        "prefill_ms": p50([s["prefill_ms"] for s in st]),
        "decode_ms": p50([s["decode_ms"] for s in st]),
        "steps": p50(steps),
        "forced": p50([s["forced_tokens"] for s in st]),
        "passes": p50([s["forced_passes"] for s in st]),
        "ms_per_step": p50([s["decode_ms"] / max(1, s["decode_steps"] + s["forced_passes"]) for s in st]),
        "tokens": p50([len(r.token_ids) for _, r in rows]),
        "kv": st[-1]["kv"],
        "call": rows[-1][1].tool_calls[0].arguments if rows[-1][1].tool_calls else "",
    }


def run_together(th, messages, *, n, max_tokens, repeats):
    """``n`` call decisions (``get_weather``, required) one after another vs stepped together
    (:func:`duplexkit.models.minicpmo45.chat.step_replies`: one batched decode step for all): p50 ms
    until the last one is done, and the decode steps the thinker ran."""
    from duplexkit.models.minicpmo45.chat import ChatReply, step_replies

    def reply():
        return ChatReply(th, messages, tools=[TOOL], tool_choice="required", temperature=0.0, max_tokens=max_tokens,
                         static_kv=True)

    out = {}
    for way in ("one after another", "together"):
        times, steps, kvs = [], [], set()
        for _ in range(repeats + 1):
            n0 = th.stats["decode_steps"]
            t0 = time.perf_counter()
            if way == "together":
                rs = [reply() for _ in range(n)]
                while not all(r.done for r in rs):
                    step_replies(th, rs)
            else:
                rs = []
                for _ in range(n):
                    r = reply()
                    while not r.done:
                        step_replies(th, [r])
                    rs.append(r)
            times.append((time.perf_counter() - t0) * 1000.0)
            steps.append(th.stats["decode_steps"] - n0)
            kvs |= {r.result.stats["kv"] for r in rs}
        out[way] = {"ms": float(np.percentile(times[1:], 50)), "steps": float(np.percentile(steps[1:], 50)),
                    "kv": "/".join(sorted(kvs))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "random-real"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokenizer-dir", default=None, help="random-real: the real tokenizer files (e.g. .tok)")
    ap.add_argument("--repeats", type=positive_int, default=3, help="counted runs per way (after one warm-up run)")
    ap.add_argument("--max-tokens", type=positive_int, default=256, help="the decider's token budget (its default)")
    ap.add_argument("--answer-tokens", type=positive_int, default=48, help="tokens of the spoken answer's text")
    ap.add_argument("--together", type=positive_int, default=8,
                    help="concurrent call decisions for the one-after-another vs together table")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    import torch

    model = build(a)
    th = model.thinker
    if torch.device(a.device).type == "cuda" and hasattr(th, "warmup"):
        th.warmup(batch_sizes=(1,), max_kv_len=1024)  # as the engine does at load (its batch buckets)
    call_msgs, answer_msgs = conversation()
    res = {}
    for name, jf, sk in WAYS:
        res["call: " + name] = run_way(th, call_msgs, tools=[TOOL], choice="required", max_tokens=a.max_tokens,
                                       jump_forward=jf, static_kv=sk, repeats=a.repeats)
    for name, sk in (("token-by-token", False), ("graphs", True)):
        res["answer: " + name] = run_way(th, answer_msgs, tools=(), choice="none", max_tokens=a.answer_tokens,
                                         jump_forward=True, static_kv=sk, repeats=a.repeats)
    if hasattr(model, "random_weights") and model.random_weights:
        print("# random weights: the call's free strings are what a random model writes (up to the schema's maxLength)")
    print(f"# {a.model} on {a.device}, p50 of {a.repeats} runs (after one warm-up run), ms")
    hdr = f"{'way':34s} | {'total':>7s} | {'prefill':>7s} | {'decode':>7s} | {'steps':>5s} | {'forced':>6s} | " \
          f"{'passes':>6s} | {'ms/step':>7s} | {'tokens':>6s} | kv"
    print(hdr)
    print("-" * len(hdr))
    for k, v in res.items():
        print(f"{k:34s} | {v['total_ms']:7.1f} | {v['prefill_ms']:7.1f} | {v['decode_ms']:7.1f} | {v['steps']:5.0f} | "
              f"{v['forced']:6.0f} | {v['passes']:6.0f} | {v['ms_per_step']:7.2f} | {v['tokens']:6.0f} | {v['kv']}")
    base, new = res["call: token-by-token"]["total_ms"], res["call: graphs + jump-forward"]["total_ms"]
    print(f"call: {base / new:.2f}x faster with graphs + jump-forward; the call: {res['call: graphs + jump-forward']['call']}")
    tog = run_together(th, call_msgs, n=a.together, max_tokens=a.max_tokens, repeats=a.repeats)
    print(f"\n# {a.together} call decisions at once (as {a.together} sessions ending their turns together), "
          "p50 ms until the last is done")
    for k, v in tog.items():
        print(f"{k:34s} | {v['ms']:8.1f} ms | {v['steps']:5.0f} decode steps | kv {v['kv']}")
    res["together"] = tog
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
