"""The mesh's three large payloads in each wire form: what building, sending and reading them costs in Python.

For a GRPO step of the GPU comparison's shape (512 samples, 40-token prompts, 256-token responses) this times,
per payload and form, the sender's build, SerializeToString, FromString and the receiver's conversion to what
the engine takes, each the median of --repeats runs in this process:

- Generate answer (rollout -> coordinator): the rollout builds it from the engine's lists; the coordinator
  reads it into its samples (coordinator/training/remote.py's own reader);
- log-probs request and answer (coordinator <-> reference / trainer);
- TrainActor request (coordinator -> trainer).

Forms: "repeated" (the baseline: repeated proto fields), "packed" (bytes per sample), "columnar" (Ragged rows
per batch, what the coordinator now uses). The coordinator side starts from what it holds in each form
(lists for repeated, numpy arrays for the others), the way coordinator/training/remote.py and phases.py leave it.

    PYTHONPATH=.:protos python bench/payloads.py --out bench/results/payloads.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "protos")]

import numpy as np  # noqa: E402

from meshrl.v1 import common_pb2, rollout_pb2, trainer_pb2  # noqa: E402
from coordinator.recipe.data import Problem  # noqa: E402
from coordinator.training import remote  # noqa: E402
from services.common import convert as common_convert  # noqa: E402
from services.rollout import convert as rollout_convert  # noqa: E402
from services.rollout.types import PromptResult, SampleResult, SamplingParams  # noqa: E402
from services.trainer import convert as trainer_convert  # noqa: E402

FORMS = ("repeated", "packed", "columnar")


def timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(stages: dict, repeats: int) -> dict:
    """stages: name -> fn(previous output); run in order, each timed on the previous stage's output."""
    out, result, prev = {}, None, None
    for name, fn in stages.items():
        seconds, result = timed(lambda: fn(prev), repeats)
        out[f"{name}_ms"] = seconds * 1e3
        prev = result
    out["total_ms"] = sum(v for k, v in out.items() if k.endswith("_ms"))
    return out


def batch(prompts: int, n: int, prompt_len: int, response_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    results = [PromptResult(prompt_id=f"p{i}", prompt_ids=rng.integers(0, 151_000, prompt_len).tolist(), samples=[
        SampleResult(response_ids=rng.integers(0, 151_000, response_len).tolist(),
                     logprobs=(-rng.random(response_len)).tolist(), text="x" * 200, finish_reason="length",
                     weight_version=1) for _ in range(n)]) for i in range(prompts)]
    problems = [Problem(id=f"q{i}", prompt="1+1=", ground_truth="2", data_source="arith") for i in range(prompts)]
    return results, problems


def generate_answer(results, problems, n: int, form: str, repeats: int) -> dict:
    sampling = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=256)
    loop = asyncio.new_event_loop()

    class Replica:
        def __init__(self, answer):
            self.answer = answer

        async def Generate(self, request):
            return self.answer

    def read(parsed):
        if form == "columnar":
            return loop.run_until_complete(remote.generate(Replica(parsed), problems, list(range(len(problems))),
                                                           sampling))
        return rollout_convert.results_from_pb(parsed)       # lists, as the coordinator held them before

    try:
        return measure({
            "build": lambda _: rollout_convert.results_to_pb(results, packed=form == "packed",
                                                             columnar=form == "columnar"),
            "serialize": lambda msg: msg.SerializeToString(),
            "parse": lambda raw: rollout_pb2.GenerateResponse.FromString(raw),
            "read": read}, repeats)
    finally:
        loop.close()


def coordinator_samples(results, form: str):
    """What the coordinator holds after Generate and advantages: lists (repeated), else numpy arrays."""
    rng = np.random.default_rng(1)
    out = []
    for r in results:
        for s in r.samples:
            adv = rng.standard_normal(len(s.response_ids)).astype(np.float32)
            ref = (-rng.random(len(s.response_ids))).astype(np.float32)
            if form == "repeated":
                out.append(SimpleNamespace(prompt_ids=r.prompt_ids, response_ids=s.response_ids,
                                           advantages=adv.tolist(), old_logprobs=[], ref_logprobs=ref.tolist()))
            else:
                out.append(SimpleNamespace(prompt_ids=np.asarray(r.prompt_ids, np.int32),
                                           response_ids=np.asarray(s.response_ids, np.int32), advantages=adv,
                                           old_logprobs=np.empty(0, np.float32), ref_logprobs=ref))
    return out


def logprobs_round(samples, form: str, repeats: int) -> dict:
    ids = [str(i) for i in range(len(samples))]
    answers = [s.ref_logprobs for s in samples]
    kw = dict(packed=form == "packed", columnar=form == "columnar")
    return measure({
        "build": lambda _: common_convert.sequences_to_pb(common_convert.SequenceBatch(
            ids=ids, prompts=[s.prompt_ids for s in samples], responses=[s.response_ids for s in samples]), **kw),
        "serialize": lambda msg: msg.SerializeToString(),
        "parse": lambda raw: common_pb2.LogProbsRequest.FromString(raw),
        "server_read": lambda req: common_convert.sequences_from_pb(req),
        "answer_build": lambda batch: common_convert.logprobs_to_pb(batch.ids, answers, 1, **kw),
        "answer_serialize": lambda msg: msg.SerializeToString(),
        "answer_parse": lambda raw: common_pb2.LogProbsResponse.FromString(raw),
        "client_read": lambda resp: common_convert.logprobs_from_pb(resp, as_arrays=form != "repeated")}, repeats)


def train_request(samples, form: str, repeats: int) -> dict:
    def build(_):
        if form == "columnar":
            request = trainer_pb2.TrainActorRequest()
            trainer_convert.train_columns_to_pb(samples, into=request.columns)
            return request
        return trainer_pb2.TrainActorRequest(samples=[trainer_convert.train_sample_to_pb(s, packed=form == "packed")
                                                      for s in samples])

    return measure({"build": build, "serialize": lambda msg: msg.SerializeToString(),
                    "parse": lambda raw: trainer_pb2.TrainActorRequest.FromString(raw),
                    "server_read": lambda req: trainer_convert.train_actor_from_pb(req)}, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="bench/results/payloads.json")
    args = ap.parse_args()
    results, problems = batch(args.prompts, args.n, args.prompt_len, args.response_len)
    out = {"benchmark": "payloads", "date": datetime.date.today().isoformat(),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
           "shape": {"samples": args.prompts * args.n, "prompt_len": args.prompt_len,
                     "response_len": args.response_len},
           "note": "medians of single-process timings; baseline = repeated fields, measured in the same run",
           "payloads": {}}
    for name, fn in (("generate_answer", lambda f: generate_answer(results, problems, args.n, f, args.repeats)),
                     ("logprobs_round_trip", lambda f: logprobs_round(coordinator_samples(results, f), f, args.repeats)),
                     ("train_actor_request", lambda f: train_request(coordinator_samples(results, f), f, args.repeats))):
        rows = {f: fn(f) for f in FORMS}
        base = rows["repeated"]["total_ms"]
        for f in FORMS:
            rows[f]["speedup_vs_repeated"] = base / rows[f]["total_ms"]
        out["payloads"][name] = rows
        print(name, "  ".join(f"{f} {rows[f]['total_ms']:.2f} ms (x{rows[f]['speedup_vs_repeated']:.1f})"
                               for f in FORMS))
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
