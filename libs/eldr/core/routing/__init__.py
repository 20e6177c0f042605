"""The routing rule: policies, the decision around them, load and expert-activity views."""
