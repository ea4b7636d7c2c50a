"""Runnable examples shipped with keras_dist (`keras-dist demo`)."""
