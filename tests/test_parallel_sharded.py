"""ShardedDense / ShardedEmbedding equal Dense / Embedding, forward and after training.

The check (`test_parallel_pipeline._sharded_vs_dense`) runs in the one process that
tests/test_parallel_pipeline.py's single-process checks share (`local_results()`).
"""

import pytest
from test_parallel_pipeline import TOLERANCE, local_results


@pytest.mark.multiworker
@pytest.mark.slow
def test_sharded_layers_equal_dense_and_embedding():
    results = local_results()["sharded"]
    for name, result in results.items():
        print(name, result)
        assert result["devices"] == ["CPU:0", "CPU:1"], name
        assert result["forward"] < TOLERANCE, name
        assert result["trained"] < TOLERANCE, name
        assert result["round_trip"] == 0.0, name
