"""The numeric-task protocol (launch/experiments/numeric_tasks.sh): `run` trains and
evaluates every loss kind x seed, `report` makes the page from the raw rows."""
