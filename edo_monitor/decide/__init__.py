"""What to do about them: the policy (floor crossings, forecasts, one pending decision),
the plans and ladders, trends and leaks, memory estimates. Pure; hands decisions to the agent."""
