"""A tiny target / DSpark-drafter pair trained from scratch for testing vllm-dspark.

``tools/train_tiny_pair.py`` runs the pipeline (:mod:`.train`); :mod:`.reference` drafts
exactly as vLLM's DSpark speculator does, for comparisons; :mod:`.vllm_check` checks an
exported pair against vLLM. Nothing here imports vLLM at import time, so training runs in
an interpreter without it.
"""
