"""One context per communicator (context), the backend choice (plan) and the measured crossover
table that ``backend="auto"`` reads (tuning)."""
