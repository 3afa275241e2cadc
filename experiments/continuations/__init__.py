"""The continuation experiment (launch/experiments/continuations.sh): `run` trains the
bases and their continuations, `report` is the pre-registered analysis and page."""
