"""Agent loops: multi-turn, tool-calling rollouts."""
