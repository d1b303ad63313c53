"""Image inputs: from a request's image reference to an ``ImageItem`` and the prompt's image tokens.

The HTTP layer calls :class:`ImageInputs` (image_inputs.py). The steps, one concept per module:

- media_limits.py: the operator's rules (allowed directory, allowed domains, size and count limits).
- image_source.py: an image reference (``data:`` URL, base64, local path, http(s) URL) to its encoded bytes.
- image_decode.py: encoded bytes to a Pillow image (PNG, JPEG, WebP), with the pixel limit checked first.
- preprocess.py: a Pillow image to an ``ImageItem`` with transformers' image processor of the checkpoint.
- prompt_tokens.py: each image's pad token in the prompt ids expanded to the image's ``num_tokens`` copies.

Every refusal is an :class:`ImageInputError` (an ``InvalidRequestError``: a 400 naming the problem).
"""
