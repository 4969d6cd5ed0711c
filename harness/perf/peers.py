"""Peers for `make perf`: other decoders of the same model, measured beside ours.

`harness.perf` calls `run_peers(...)` after its own `generate` comparison; this module adds, on the
same embedded model, dtype, Spec-Bench prompts (our chat template's token ids), max new tokens and
stopping rule (greedy, EOS):

  * our prompt lookup decoding (`methods/pld.py`, `conf/method/pld.yaml`) and `transformers`'
    `generate(prompt_lookup_num_tokens=10, max_matching_ngram_size=3)`;
  * llama.cpp through `llama-cpp-python` (the optional extra: `pip install -e '.[peers]'`), on the
    embedded GGUF requantized by llama.cpp itself to the run's dtype (F32 / BF16 / F16; made once under
    the suite's cache): its AR loop (`Llama.generate`, greedy sampler), its prompt-lookup speculative
    decoding (`LlamaPromptLookupDecoding` as `draft_model`), and its forward latency t(n), n = 1..16
    tokens after a 256-token prefix, with logits for every position (`logits_all=True`, as a verify
    step needs them);
  * in an fp32 run, the half precisions side by side: our AR on the target in bf16w (weights rounded
    to bf16, fp32 arithmetic) and llama.cpp's AR and t(n) on the GGUF requantized to BF16.

It prints one table (`format_table`): per engine tokens/s, t(1), t(8)/t(1), t(16)/t(1), the share of the
roofline t(1) reaches (roofline seconds / t(1)) and how many prompts' tokens equal our AR's. A peer
that cannot run is skipped with a one-line reason, never an exception.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
import torch
from omegaconf import OmegaConf

from harness.perf.workload import greedy_generate, spec_bench_prompts, timed_generations
from harness.running.prompts import ChatTemplate
from methods.ar import AutoregressiveDecoder
from methods.engine.native import WEIGHTS_BF16
from methods.engine.runner import ModelRunner
from methods.engine.storage import cache_root
from methods.models.loading import gguf_source, load_draft_lm
from methods.models.specs import PROJECT_ROOT as REPO
from methods.models.specs import ModelSpec
from methods.pld import UPSTREAM_DRAFT, PLDSettings, PromptLookupDecoder
from methods.sps import SpeculativeSamplingDecoder

INSTALL_HINT = "pip install -e '.[peers]'"
CURVE_SIZES = (1, 2, 4, 8, 16)
# llama.cpp's file types (include/llama.h `enum llama_ftype`) by torch dtype
FTYPES = {torch.float32: ("F32", "LLAMA_FTYPE_ALL_F32"), torch.bfloat16: ("BF16", "LLAMA_FTYPE_MOSTLY_BF16"),
          torch.float16: ("F16", "LLAMA_FTYPE_MOSTLY_F16")}

# Table rows, in this order: key -> label
ENGINES = {
    "ar_ours": "ours AR", "pld_ours": "ours PLD", "sps_ours": "ours SpS",
    "ar_generate": "generate", "sps_generate": "generate assisted", "pld_generate": "generate PLD",
    "llama_ar": "llama.cpp AR", "llama_pld": "llama.cpp prompt-lookup",
    "ar_ours_bf16w": "ours AR bf16w", "llama_ar_bf16": "llama.cpp AR BF16",
}
HALF = ("ar_ours_bf16w", "llama_ar_bf16")  # the half-precision rows: an fp32 run's bf16w beside llama.cpp's BF16
COLUMNS = (("tokens/s", "tokens_per_second", "{:.2f}"), ("t(1) ms", "t1_ms", "{:.1f}"),
           ("t(8)/t(1)", "t8_over_t1", "{:.2f}x"), ("t(16)/t(1)", "t16_over_t1", "{:.2f}x"),
           ("% roofline", "roofline_percent", "{:.0f}%"), ("tokens = our AR", "identical", "{}"))


class PeerUnavailable(Exception):
    """A peer that cannot run here; its message is the one-line reason."""


# ---------------------------------------------------------------------------------------------- table

def format_table(rows: Sequence[dict]) -> str:
    """Rows (dicts with `engine` and any of the COLUMNS keys; None or absent = not measured, `note` =
    why) as one aligned text table. Pure: no I/O."""
    frame = pd.DataFrame({"engine": [str(row["engine"]) for row in rows],
                          **{title: ["-" if row.get(key) is None else fmt.format(row[key]) for row in rows]
                             for title, key, fmt in COLUMNS}})
    table = frame.to_markdown(index=False, tablefmt="simple", disable_numparse=True,
                              colalign=("left", *["right"] * len(COLUMNS)))
    notes = [f"  {row['engine']}: {row['note']}" for row in rows if row.get("note")]
    return "\n".join([table, *notes])


def curve_columns(curve: dict | None, roofline: float | None) -> dict:
    """t(1) ms, t(8)/t(1), t(16)/t(1) and % of roofline from a {tokens: seconds} curve."""
    if not curve or not curve.get(1):
        return {}
    one = curve[1]
    return {"t1_ms": 1000 * one, "t8_over_t1": curve[8] / one if curve.get(8) else None,
            "t16_over_t1": curve[16] / one if curve.get(16) else None,
            "roofline_percent": 100 * roofline / one if roofline else None}


def identical_cell(outputs: dict[int, list[int]] | None, reference: dict[int, list[int]]) -> str | None:
    if not outputs:
        return None
    same = sum(outputs[i] == reference.get(i) for i in outputs)
    return f"{same}/{len(outputs)}"


def table_rows(result: dict, peers: dict) -> list[dict]:
    """The table's rows from perf's result (its curves, roofline, `generate` comparison) and ours."""
    roofline = result.get("roofline_seconds")
    curves = result.get("forward_seconds_by_tokens") or {}
    ours_curve, stock_curve = curves.get("auto"), curves.get("off")
    llama_curve = (peers.get("llama_cpp") or {}).get("forward_seconds_by_tokens")
    curve_of = {"ar_ours": ours_curve, "pld_ours": ours_curve, "sps_ours": ours_curve,
                "ar_generate": stock_curve, "sps_generate": stock_curve, "pld_generate": stock_curve,
                "llama_ar": llama_curve, "llama_pld": llama_curve, "ar_ours_bf16w": curves.get(WEIGHTS_BF16),
                "llama_ar_bf16": (peers.get("llama_cpp_bf16") or {}).get("forward_seconds_by_tokens")}
    speed = {**(result.get("tokens_per_second_median") or {}), **(peers.get("tokens_per_second_median") or {})}
    identical = dict(peers.get("identical_to_ar_ours") or {})
    same = result.get("same_tokens") or {}
    if "ar_generate" not in identical and "ar" in same and "prompts" in result:  # perf's own all-prompts check
        identical["ar_generate"] = (
            f"{result['prompts']}/{result['prompts']}" if same["ar"] else f"<{result['prompts']}/{result['prompts']}"
        )
    sps = peers.get("identical_to_ar_ours_sps")
    if sps:
        identical.setdefault("sps_ours", sps)
        same_count, total = sps.split("/")
        if "sps" in same and same_count == total:  # perf compared ours SpS with generate's, prompt by prompt
            identical.setdefault("sps_generate", sps if same["sps"] else f"<{total}/{total}")
    skipped = peers.get("skipped") or {}
    rows = []
    for key, label in ENGINES.items():
        if key in HALF and WEIGHTS_BF16 not in curves:
            continue  # a run without a bf16w target has no half-precision rows
        roof = result.get("roofline_seconds_bf16w") if key in HALF else roofline
        row = {"engine": label, "tokens_per_second": speed.get(key), **curve_columns(curve_of[key], roof),
               "identical": "ref" if key == "ar_ours" else identical.get(key)}
        if key in skipped:
            row["note"] = skipped[key]
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ llama.cpp

def import_llama_cpp():
    """The `llama_cpp` module, or PeerUnavailable with a one-line reason."""
    try:
        import llama_cpp  # lazy: llama_cpp, the optional [peers] extra
        from llama_cpp import llama_speculative  # noqa: F401 (lazy: llama_cpp, the optional [peers] extra)
    except Exception as err:  # ImportError, or a broken build failing to load its shared library
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PeerUnavailable(f"llama_cpp not importable ({first}); install the extra: {INSTALL_HINT}") from None
    return llama_cpp


def requantized_gguf(source: Path, dtype: torch.dtype, folder: Path | None = None, threads: int | None = None) -> Path:
    """`source` requantized by llama.cpp's own `llama_model_quantize` to the file type of `dtype`
    (F32 / BF16 / F16), made once under `folder` (default: the suite's cache, `gguf/`) and reused."""
    llama_cpp = import_llama_cpp()
    if dtype not in FTYPES:
        raise PeerUnavailable(f"no llama.cpp file type for {dtype}")
    suffix, ftype = FTYPES[dtype]
    if folder is None:
        folder = cache_root() / "gguf"
    target = Path(folder) / f"{source.stem}-{source.stat().st_size}.{suffix}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    try:  # llama.cpp logs every tensor it converts; keep errors only (as Llama(verbose=False) does)
        from llama_cpp import _logger  # lazy: llama_cpp, the optional [peers] extra
        _logger.set_verbose(False)
    except Exception:
        pass
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.allow_requantize = True  # the embedded file is Q4_1: dequantize, then write F32/BF16/F16
    params.nthread = threads or torch.get_num_threads()
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise PeerUnavailable(f"llama_model_quantize({source.name} -> {suffix}) failed with status {status}")
    partial.rename(target)
    return target


def llama_model(path: Path, n_ctx: int, logits_all: bool = False, draft_model=None, threads: int | None = None):
    from llama_cpp import Llama  # lazy: llama_cpp, the optional [peers] extra

    threads = threads or torch.get_num_threads()
    return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
                 logits_all=logits_all, draft_model=draft_model, verbose=False)


def llama_greedy(llama, prompt: Sequence[int], stop) -> list[int]:
    """Greedy tokens after `prompt` (token ids) until `stop` (a StopCondition) says so. The state is
    reset first, so each call evaluates its whole prompt once (no prefix reuse between calls)."""
    llama.reset()
    out: list[int] = []
    for token in llama.generate(list(prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(token))
        cut = stop.cut(out, len(out) - 1)
        if cut is not None:
            return out[: cut[0]]
    return out


def llama_curve(llama, sizes=CURVE_SIZES, prefix: int = 256, rounds: int = 7) -> dict[int, float]:
    """Median seconds of `llama.eval` over n tokens after a `prefix`-token prefix (the cache rolled back to
    the prefix after each), sizes interleaved round by round, as the machine profile's `curves.forward_latencies`."""
    llama.reset()
    llama.eval([0] * prefix)
    llama.eval([0] * 4)  # warm
    llama.n_tokens = prefix
    samples = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            start = time.perf_counter()
            llama.eval([0] * n)
            samples[n].append(time.perf_counter() - start)
            llama.n_tokens = prefix  # eval removes the cache entries past n_tokens before it decodes
    llama.reset()
    return {n: statistics.median(v) for n, v in samples.items()}


# ------------------------------------------------------------------------------------------------ run

def pld_params() -> dict:
    """PLD's settings as `make bench METHOD=pld` runs it (conf/method/pld.yaml, checked), its draft length
    upstream's (the one `generate(prompt_lookup_num_tokens=...)` is given too): `auto` is this machine's."""
    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "method" / "pld.yaml"), resolve=True)
    settings = PLDSettings.from_params(cfg).to_dict()
    if settings["num_draft"] == "auto":
        settings["num_draft"] = UPSTREAM_DRAFT
    return settings


def say(line: str) -> None:
    print(f"  {line}", flush=True)


def run_peers(args, model, tokenizer, config, device, result: dict, profile, half=None) -> dict:
    """Measure the peers; print the table; return {"peers": {...}} for perf's JSON. Never raises for
    a missing or failing peer: it is skipped with a one-line reason. With `half` (the target in bf16w,
    an fp32 run's), our AR on it and llama.cpp's on a BF16 GGUF join the same loop."""
    print("peers (harness/perf/peers.py): our PLD, generate's PLD, llama.cpp", flush=True)
    dtype = next(model.parameters()).dtype
    template = ChatTemplate.for_model(config, tokenizer)
    prompts = spec_bench_prompts(template, args.questions)
    stop = template.stop_condition(args.max_new_tokens)
    eos = sorted(stop.eos_token_ids)
    pld = pld_params()
    peers: dict = {"pld": pld, "skipped": {}}
    curve_only = getattr(args, "curve_only", False)

    hf = greedy_generate(model, device, args.max_new_tokens, eos)

    ours_ar = AutoregressiveDecoder(ModelRunner(model, profile=profile))
    ours_pld = PromptLookupDecoder(ModelRunner(model, profile=profile), **pld)
    contenders: dict[str, Callable[[list[int]], list[int]]] = {
        "ar_ours": lambda p: ours_ar.generate(p, stop).tokens,
        "pld_ours": lambda p: ours_pld.generate(p, stop).tokens,
        "pld_generate": lambda p: hf(p, prompt_lookup_num_tokens=pld["num_draft"],
                                     max_matching_ngram_size=pld["max_ngram"]),
    }
    if half is not None:
        ours_half = AutoregressiveDecoder(ModelRunner(half, profile=profile))
        contenders["ar_ours_bf16w"] = lambda p: ours_half.generate(p, stop).tokens
    if pld["branches"] != 1:
        say(f"note: conf/method/pld.yaml has branches={pld['branches']}; generate's PLD proposes one chain")

    # llama.cpp: requantize, load, curve
    try:
        import_llama_cpp()
        import llama_cpp  # lazy: llama_cpp, the optional [peers] extra
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # lazy: llama_cpp, the optional [peers] extra

        if device.type != "cpu":
            say(f"note: llama.cpp runs on the CPU here (the extra is a CPU build); ours on {device}")
        source = gguf_source(ModelSpec.from_mapping(config))
        start = time.perf_counter()
        path = requantized_gguf(source, dtype)
        say(f"llama.cpp {llama_cpp.__version__}: {path.name} ({time.perf_counter() - start:.1f} s to find/make)")
        n_ctx = max(max(len(p) for p in prompts) + args.max_new_tokens + 32, 256 + max(CURVE_SIZES) + 8)
        llama_ar = llama_model(path, n_ctx, logits_all=False)
        # the draft model makes llama-cpp-python keep logits for every position (the verify step needs them)
        llama_pld = llama_model(path, n_ctx, draft_model=LlamaPromptLookupDecoding(
            max_ngram_size=pld["max_ngram"], num_pred_tokens=pld["num_draft"]))
        peers["llama_cpp"] = {"version": llama_cpp.__version__, "gguf": str(path), "n_ctx": n_ctx,
                              "threads": torch.get_num_threads(),
                              "forward_seconds_by_tokens": llama_curve(llama_pld)}
        contenders["llama_ar"] = lambda p: llama_greedy(llama_ar, p, stop)
        contenders["llama_pld"] = lambda p: llama_greedy(llama_pld, p, stop)
        if half is not None:  # llama.cpp's half precision beside our bf16w
            half_path = requantized_gguf(source, torch.bfloat16)
            llama_half = llama_model(half_path, n_ctx, logits_all=True)
            peers["llama_cpp_bf16"] = {"gguf": str(half_path), "forward_seconds_by_tokens": llama_curve(llama_half)}
            contenders["llama_ar_bf16"] = lambda p: llama_greedy(llama_half, p, stop)
    except Exception as err:  # PeerUnavailable, or llama.cpp failing on this machine
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if not isinstance(err, PeerUnavailable):
            reason = f"{type(err).__name__}: {reason}"
        say(f"llama.cpp skipped: {reason}")
        peers["skipped"].update({"llama_ar": reason, "llama_pld": reason, "llama_ar_bf16": reason})

    if not curve_only:
        peers.update(time_contenders(contenders, prompts, args.repeats, device))
        peers.update(check_sps(args, model, config, prompts, stop, peers["outputs"]["ar_ours"], profile))
    rows = table_rows(result, peers)
    print(f"peers table ({result.get('dtype', dtype)}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
          f"median tokens/s; t(n): target forward after a 256-token prefix; ours SpS/generate/generate assisted "
          f"tokens/s from the comparison above, the other rows from the peers loop):")
    print(format_table(rows), flush=True)
    peers["table"] = rows
    peers.pop("outputs", None)
    return {"peers": peers}


def time_contenders(contenders: dict, prompts: list[list[int]], repeats: int, device) -> dict:
    """Contenders interleaved per prompt, `repeats` times; median tokens/s; per-prompt identity to ours AR."""
    failed: dict[str, str] = {}
    for name, run in list(contenders.items()):  # warm-up; a contender failing here is skipped
        try:
            run(prompts[0][:32])
        except Exception as err:
            failed[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            say(f"{ENGINES.get(name, name)} skipped: {failed[name]}")
            del contenders[name]

    speeds, outputs = timed_generations(contenders, prompts, repeats, device)
    reference = outputs.get("ar_ours", {})
    identical = {name: identical_cell(out, reference) for name, out in outputs.items() if name != "ar_ours"}
    return {"tokens_per_second_median": {n: statistics.median(v) for n, v in speeds.items()},
            "identical_to_ar_ours": identical, "first_difference_at": first_differences(outputs, reference),
            "outputs": outputs, "skipped_contenders": failed}


def first_differences(outputs: dict[str, dict[int, list[int]]], reference: dict[int, list[int]]) -> dict:
    """{contender: {prompt index: first position whose token differs from our AR's}} (differing prompts only)."""
    found: dict = {}
    for name, out in outputs.items():
        for index, tokens in out.items():
            ref = reference.get(index, [])
            if tokens != ref:
                at = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
                found.setdefault(name, {})[index] = at
    return found


def check_sps(args, model, config, prompts, stop, reference: dict[int, list[int]], profile) -> dict:
    """Our SpS's tokens (untimed, once) against our AR's: the identity column of the SpS rows
    (`generate` assisted: identical when ours SpS is and perf found both SpS equal)."""
    try:
        draft_spec = ({"target_layers": args.draft_layers} if getattr(args, "draft_layers", None)
                      else OmegaConf.to_container(config.drafts.sps, resolve=True))
        decoder = SpeculativeSamplingDecoder(ModelRunner(model, profile=profile), load_draft_lm(draft_spec, model),
                                             gamma=args.gamma)
        outputs = {i: decoder.generate(p, stop).tokens for i, p in enumerate(prompts)}
    except Exception as err:
        say(f"SpS identity check skipped: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return {}
    return {"identical_to_ar_ours_sps": identical_cell(outputs, reference),
            "first_difference_at_sps": first_differences({"sps_ours": outputs}, reference).get("sps_ours", {})}
