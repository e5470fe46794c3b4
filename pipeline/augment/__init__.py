"""Detection augmentation as composable ops: every geometric step of one output image is one matrix per source image.

Ultralytics trains YOLO with a recipe of full-image passes: each image
resized, four pasted into a 2S x 2S canvas (mosaic), the canvas warped
(random affine: scale, translate, rotation, shear, perspective), then
flipped and colour-jittered. Here each geometric op is a map of points,
and the ops of one output compose into one 3x3 matrix per source image
(from its original pixels to the output's) and a window (the part of the
output it shows): the pixels are resampled once, straight from the decoded
source, and the boxes go through the same matrix. The draws follow
ultralytics' order and formulas, so the same draws give the same boxes.

The package map:

    warp.py      3x3 matrices, boxes through them, ultralytics' box filter (`box_candidates`)
    mosaic.py    `Mosaic`: four images around a random centre of a 2S x 2S canvas
    affine.py    `RandomAffine`: ultralytics' RandomPerspective matrix (degrees, translate, scale, shear, perspective)
    copy_paste.py  ultralytics' `CopyPaste` (mode "flip"): which instances are mirrored, and the outlines' pixels
    yolo.py      `YoloRecipe` (ultralytics' default hyperparameters) and `plan`: one output's sources, matrices, boxes
    render.py    one planned output's pixels on the CPU: the native resampler where a matrix is axis-aligned
    device_render.py  a batch of planned outputs in torch on any device: ultralytics' resize, paste and one warp (`render_batch`)
    masks.py     one planned output's masks (classes, each box's own): each source's sampled nearest through its matrix
    hsv.py       `HSV`: ultralytics' hue, saturation and value gains, per batch in torch, per image in native code
    color.py     `ColorJitter`: torchvision's brightness, contrast, saturation and hue, per image, on a uint8 batch or image
    mixup.py     ultralytics' MixUp and CutMix on a batch: outputs blended with, or patched from, others of the batch
    ops.py       `make_loader(augment=[...])`: the ops (RandomResizedCrop ... CutMix) and the loader settings they come to
"""
