"""The pipeline that trains, calibrates, evaluates and exports the tiny pair.

``tools/train_tiny_pair.py`` runs it (:mod:`.train`); :mod:`.export` writes the folders
``vllm_dspark.tiny_pair.load`` reads back; :mod:`.vllm_check` checks an exported pair
against vLLM. Only :mod:`.vllm_check` needs vLLM, so training runs in an interpreter
without it.
"""
