import pytest
from vllm.engine.arg_utils import EngineArgs

import vllm_dspark
from vllm_dspark.patches.wrapping import ORIGINAL_ATTR, original
from vllm_dspark.plugin import UnsupportedVllmVersion, check_vllm_version


@pytest.mark.parametrize("installed", ["0.26.0", "0.26.0+cu130"])
def test_supported_vllm_versions(installed):
    check_vllm_version(installed)


@pytest.mark.parametrize("installed", ["0.25.1", "0.26.1", "0.27.0", "0.26.0rc1", "0.26.0.dev3"])
def test_other_vllm_versions_are_refused_in_one_line(installed):
    with pytest.raises(UnsupportedVllmVersion) as error:
        check_vllm_version(installed)
    message = str(error.value)
    assert "\n" not in message
    assert f"found vLLM {installed}" in message and "vllm==0.26.0" in message


def test_register_is_idempotent():
    vllm_dspark.register()
    first = EngineArgs.create_speculative_config
    vllm_dspark.register()
    from vllm_dspark.patches import speculative_options

    speculative_options.apply()  # even a patch applied twice wraps once
    assert EngineArgs.create_speculative_config is first
    assert hasattr(first, ORIGINAL_ATTR)
    assert not hasattr(original(EngineArgs, "create_speculative_config"), ORIGINAL_ATTR)
