"""The update's machinery: AdamW and its schedule, minibatches, the update's metrics; PPO's critic."""
