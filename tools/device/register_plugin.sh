#!/usr/bin/env bash
# On a GPU machine with no package registry: make this checkout importable and visible to
# vLLM as a general plugin, without pip (no build backend can be fetched there).
# Source it from the checkout root, after vLLM's own site dir is on PYTHONPATH:
#   . tools/device/register_plugin.sh SITE_DIR
site=${1:?usage: . tools/device/register_plugin.sh SITE_DIR}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
info="$site/vllm_dspark-$version.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: vllm-dspark\nVersion: %s\n' "$version" > "$info/METADATA"
# The entry points pyproject.toml declares.
printf '[vllm.general_plugins]\nvllm_dspark = vllm_dspark:register\n\n[console_scripts]\nvllm-dspark = vllm_dspark.cli:main\n' \
  > "$info/entry_points.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "from importlib.metadata import entry_points as e; print([p.name for p in e(group='vllm.general_plugins')])"
