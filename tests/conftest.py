"""Shared test set-up. Kept light: importing TensorFlow here would slow every test."""

import os

# Quiets TensorFlow's C++ start-up logs in this process and, inherited, in the workers.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
