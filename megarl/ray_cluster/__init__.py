"""Ray plumbing: the session (embedded or attached), placement groups per role, and worker
groups that run N copies of a plain worker class with torchrun's environment."""
