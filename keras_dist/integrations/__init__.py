"""Integrations with cluster engines that start the workers themselves.

* `keras_dist.integrations.ray`: Ray Train (`TensorflowTrainer`). Import it explicitly;
  it needs the `ray` extra (`pip install "keras-dist[ray]"`).
"""
