"""The one result schema every backend writes, what is checked against it, and how it is written out."""
