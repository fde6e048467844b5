"""What the on-policy algorithms (PPO, RecurrentPPO) share: the PPO loss and its statistics, the timeout bootstrap."""
