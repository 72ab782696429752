"""Lab equipment of the repository: what makes and checks artifacts, never shipped in the
wheel (the runtime package is ``vllm_dspark/``)."""
