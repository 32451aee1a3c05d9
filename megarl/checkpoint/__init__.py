"""Checkpoints: atomic verified save / resume (manager.py, verification.py), the controller's
state (trainer_state.py), model checkpoints of HF -> Megatron conversion and SFT
(model_checkpoint.py), what a run recorded (run_record.py) and Megatron's dist-checkpoint save
(dist_save.py). The conversions themselves run in megarl/actors/conversion_rank.py."""
