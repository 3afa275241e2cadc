"""The confirmatory experiment: DEL at α = 0.1 against MLE, pre-registered (run, report,
prior)."""
