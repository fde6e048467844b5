"""What the on-policy algorithms (PPO, RecurrentPPO, A2C) share: the PPO loss and its statistics, the timeout bootstrap,
the fast rollout buffer and the conditions of the fast paths."""
