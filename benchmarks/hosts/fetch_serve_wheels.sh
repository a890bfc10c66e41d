#!/usr/bin/env bash
# OPTIONAL helper: download, where there is network, the wheels (Python 3.12, x86-64) that h200_check.sh's
# servedeps and infinity parts install on a GPU machine without network:
#   .whl/inf    Infinity 0.0.78 (`infinity-emb[server]`, no sentence-transformers: its SigLIP/CLIP path needs
#               none) with transformers 4.57.6 and huggingface_hub 0.36 (it pins transformers < 5), and
#               aiohttp; the host's torch and its own dependencies are not downloaded (44 MiB)
#   .whl/serve  python-multipart and pybase64 (mmenc serve's extra; fastapi, uvicorn and pydantic come from
#               .whl/inf)
# The pins are those one `pip install "infinity-emb[server]==0.0.78" transformers==4.57.6 pillow aiohttp`
# resolved on 2026-12-04 (numpy left out: Infinity ran with the host's numpy 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
tags=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p .whl/inf .whl/serve
python3 -m pip download --no-deps "${tags[@]}" -d .whl/inf aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 attrs==26.1.0 backoff==2.2.1 certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.1.8 distro==1.9.0 fastapi==0.165.0 frozenlist==1.8.0 h11==0.16.0 hf-xet==1.8.0 httptools==0.9.0 huggingface_hub==0.36.2 idna==3.20 infinity_emb==0.0.78 markdown-it-py==4.3.0 mdurl==0.1.2 multidict==7.2.1 opentelemetry-api==1.45.2 orjson==3.13.0 packaging==26.4 pillow==13.0.0 posthog==7.91.1 prometheus-fastapi-instrumentator==8.1.0 prometheus_client==0.26.0 propcache==0.5.4 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 python-dotenv==1.2.4 PyYAML==6.0.4 regex==2026.11.19 requests==2.34.2 rich==13.9.4 safetensors==0.8.0 shellingham==1.5.4 starlette==1.10.0 tokenizers==0.22.2 tqdm==4.70.1 transformers==4.57.6 typer==0.12.5 typing-inspection==0.4.5 urllib3==2.8.0 uvicorn==0.32.1 uvloop==0.23.0 watchfiles==1.3.0 websockets==17.4 yarl==1.25.1 
python3 -m pip download --no-deps "${tags[@]}" -d .whl/serve python-multipart==0.0.34 pybase64==1.5.1
du -sh .whl/inf .whl/serve
