# autoparallel: make demo | make train-example | make test | make test-fast | make bench | make bench-speed | make bench-memory | make clean

PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

.PHONY: test test-fast demo train-example bench bench-speed bench-memory clean venv

venv: $(STAMP)

# torch==2.13.0 goes in first: with it already present, the project's pin is
# satisfied and pip does not fetch a multi-GB CUDA build. Then torchvision==0.28.0 (it
# requires torch==2.13.0), before timm: an unpinned torchvision pulls torch 2.15 and CUDA.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install torchvision==0.28.0
	$(PIP) install -e '.[hf,test,triton]'
	touch $(STAMP)

# the whole suite: in-process tests on two pytest-xdist workers (one per core), then the tests
# that spawn real gloo processes or assert on measured rates, one at a time (each runs 2 or 4
# ranks on the two cores; a rate measured beside another test measures that test's load)
test: $(STAMP)
	$(PY) -m pytest tests -x -n 2 -m "not multiprocess and not timing" --durations=15
	$(PY) -m pytest tests -x -m "multiprocess or timing" --durations=10

# everyday tier: no real processes, no parity matrices over every model, mesh and cost model;
# two pytest-xdist workers (one per core here)
test-fast: $(STAMP)
	$(PY) -m pytest tests -x -n 2 -m "not slow and not multiprocess and not timing" --durations=10

# OMP_NUM_THREADS set: torchrun prints a banner when it sets it itself (each rank uses one thread anyway)
demo: $(STAMP)
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 4 examples/train_gpt2.py

# examples/train.py on 2 gloo processes: 20 steps of a tiny GPT-2, a checkpoint at step 10, then resumed from it
train-example: $(STAMP)
	$(PY) -m autoparallel train --model gpt2 --layers 2 --hidden 64 --vocab 128 --batch 8 --seq 32 --mesh 2 \
		--steps 20 --checkpoint-dir /tmp/autoparallel-train-example --save-at 10
	$(PY) -m autoparallel train --model gpt2 --layers 2 --hidden 64 --vocab 128 --batch 8 --seq 32 --mesh 2 \
		--steps 20 --checkpoint-dir /tmp/autoparallel-train-example --resume

bench: $(STAMP)
	$(PY) benchmarks/plan_time.py

# step time and peak memory against DDP, FSDP2, Megatron TP and FSDP2+TP (torchrun, worlds 1, 2 and 4)
bench-speed: $(STAMP)
	$(PY) benchmarks/vs_torch.py

# the same recipes and ZeRO-1, FSDP2 variants, checkpointing, offload under 0.4/0.6/0.8 x DDP's peak (worlds 2 and 4)
bench-memory: $(STAMP)
	$(PY) benchmarks/memory_bound.py

clean:
	rm -rf .venv
