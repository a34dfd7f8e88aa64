"""The validate floor: the estimator checked against the trace or a real measurement over named matrices of
set-ups (matrices), and the comparison (compare)."""
