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
