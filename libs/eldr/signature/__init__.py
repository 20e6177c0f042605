"""The signature service's state: blocks seen per request and signatures built from them."""
