"""Checkpoints: atomic verified save / resume (manager.py) and the controller's state
(trainer_state.py). HF export / import lives in hf_convert.py."""
