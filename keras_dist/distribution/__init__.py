"""Keras's own `keras.distribution` API on the TensorFlow backend, on DTensor.

Keras ships `keras.distribution` (DeviceMesh, LayoutMap, DataParallel, ModelParallel) for
JAX; its TensorFlow `distribution_lib` is a prototype. keras_dist provides the TensorFlow
one on `tf.experimental.dtensor` (why DTensor: docs/keras_distribution_engine.md).
Work in progress (issue 25): not installed into Keras yet.
"""
