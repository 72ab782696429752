"""The tiny target / DSpark-drafter pair shipped in ``vllm_dspark/data/tiny_pair``.

:mod:`.drafter` and :mod:`.target` are the pair's models in PyTorch, :mod:`.load` reads an
exported pair and :mod:`.reference` drafts exactly as vLLM's DSpark speculator does, for
comparisons and the CPU demo. The trainer that made the pair is ``lab/tiny_pair/`` in the
repository. Nothing here imports vLLM at import time.
"""
