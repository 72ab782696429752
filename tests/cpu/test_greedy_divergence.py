"""Classifying where a greedy output leaves its reference (used by the GPU tests)."""

from gpu_results import first_divergences


def test_each_differing_output_gets_its_first_divergence_and_the_gap_there():
    reference = {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [9, 9]}
    gaps = {"a": [2.0, 0.0001, 3.0, 1.0], "b": [0.5, 0.5, 4.0], "c": [1.0, 1.0]}
    outputs = {"a": [1, 7, 8, 8], "b": [5, 6, 8], "c": [9, 9]}
    assert first_divergences(outputs, reference, gaps) == {
        "a": {"position": 1, "gap": 0.0001},
        "b": {"position": 2, "gap": 4.0},
    }
