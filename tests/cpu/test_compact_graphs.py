import pytest

from vllm_dspark.verify.compact_graphs import capture_query_lengths


@pytest.mark.parametrize(
    "num_reqs,num_tokens,lengths",
    [
        (8, 8, [4, 4, 0, 0, 0, 0, 0, 0]),
        (4, 10, [4, 4, 2, 0]),
        (4, 16, [4, 4, 4, 4]),
        (3, 1, [1, 0, 0]),
    ],
)
def test_capture_queries_are_decode_length_then_empty(num_reqs, num_tokens, lengths):
    assert capture_query_lengths(num_reqs, num_tokens, query_len=4).tolist() == lengths


@pytest.mark.parametrize("num_reqs,num_tokens", [(4, 17), (4, 0)])
def test_capture_queries_must_fit(num_reqs, num_tokens):
    with pytest.raises(ValueError, match="do not fit"):
        capture_query_lengths(num_reqs, num_tokens, query_len=4)


def test_a_classmethod_is_wrapped_as_a_classmethod_once():
    from vllm_dspark.patches.wrapping import original, wrap

    class Batch:
        @classmethod
        def make(cls, n):
            return cls, n

    calls = []

    def make_wrapper(make):
        def counted(cls, n):
            calls.append(n)
            return make(cls, n)

        return counted

    stock = Batch.make.__func__
    wrap(Batch, "make", make_wrapper)
    wrap(Batch, "make", make_wrapper)  # idempotent

    class Subclass(Batch):
        pass

    assert Subclass.make(3) == (Subclass, 3)
    assert calls == [3]
    assert original(Batch, "make") is stock


def test_one_token_graphs_are_vllms_plain_decode_graphs_up_to_max_num_seqs():
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    from vllm_dspark.verify.compact_graphs import one_token_graph_descriptors

    descs = one_token_graph_descriptors([16, 1, 4, 2, 8, 4], max_num_reqs=8, max_capture_size=512)
    assert [(d.num_tokens, d.num_reqs, d.uniform_token_count) for d in descs] == [
        (1, 1, 1),
        (2, 2, 1),
        (4, 4, 1),
        (8, 8, 1),
    ]
    # The descriptor vLLM lists for a one-token decode graph (Dynamic SD): captured once.
    assert descs[2] == BatchExecutionDescriptor(CUDAGraphMode.FULL, 4, 4, uniform_token_count=1)
    assert (
        one_token_graph_descriptors([1, 2, 4, 8], max_num_reqs=8, max_capture_size=2)[-1]
        == (descs[1])
    )


def test_steps_of_one_token_a_request_take_one_token_graphs_only_where_listed():
    """Where the list has one-token graphs (DeepSeek-V4) a step of one token a request
    takes one of them and no other step does; without them (FlashAttention 3) it takes a
    variable-length graph, as before."""
    from vllm_dspark.verify.compact_graphs import (
        compact_graph_descriptors,
        one_token_graph_descriptors,
        pick_compact_graph,
    )

    varlen = compact_graph_descriptors([2, 4, 8, 16], 4, 3, 16)
    one_token = one_token_graph_descriptors([1, 2, 4, 8, 16], 4, 16)
    both = sorted(varlen + one_token, key=lambda desc: desc.num_tokens)
    captured = set(both)
    assert pick_compact_graph(varlen, captured, num_reqs=3, num_tokens=3) == varlen[1]
    assert pick_compact_graph(both, captured, num_reqs=3, num_tokens=3) == one_token[2]
    assert pick_compact_graph(both, captured, num_reqs=2, num_tokens=3) == varlen[1]
    assert pick_compact_graph(both, captured - {one_token[2]}, num_reqs=3, num_tokens=3) is None
