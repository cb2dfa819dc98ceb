"""Who may do what: API tokens (``tokens``) and the policy for user-supplied paths and code (``policy``)."""
