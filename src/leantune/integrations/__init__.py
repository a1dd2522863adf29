"""Other libraries' trainers with leantune inside: :mod:`leantune.integrations.trl` (TRL's SFTTrainer, DPOTrainer).

Each module imports its library only when called, so ``import leantune`` never needs it."""
