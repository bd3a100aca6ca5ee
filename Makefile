# The two commands (see README.md):
#   make run    set up .venv and run the main job (tiny CPU default)
#   make test   set up .venv and run the test suite (8 simulated CPU devices)
.PHONY: run test test-full setup setup-test train-tiny answer clean
WORKDIR ?= runs/tiny

setup:
	tools/bootstrap.sh runtime

setup-test:
	tools/bootstrap.sh test

# The tiny RL run: SFT warm start + async GRPO on synthetic arithmetic (8 simulated CPU devices),
# held-out accuracy before/after in $(WORKDIR)/summary.json. ~10-15 min on 2 cores.
run: setup
	.venv/bin/python launch/train.py --config=configs/tiny.py --workdir=$(WORKDIR)

train-tiny: run

# The shipped SmolLM2-135M-Instruct answers one GSM8K problem (greedy, KV cache): answer.json.
answer: setup
	.venv/bin/python launch/answer.py --workdir=$(WORKDIR)

test: setup-test
	tools/test.sh $(PYTEST_ARGS)

# The suite with the end-to-end learning proofs (tests marked `long`): before a release, and after
# a change to what a run learns.
test-full: setup-test
	MAGISTRAL_TEST_FULL=1 tools/test.sh $(PYTEST_ARGS)

clean:
	rm -rf .venv runs
