"""Who may send what, when: scheduling policies and the server load they react to."""
