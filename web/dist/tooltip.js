// One floating tooltip for every figure: lines of text, optionally bold or with a swatch.

export class Tooltip {
  constructor(node) {
    this.node = node;
  }

  /** lines: [text, "b" for bold, swatch colour] each. */
  show(event, lines) {
    const n = this.node;
    n.replaceChildren(
      ...lines.map(([text, bold, swatch]) => {
        const d = document.createElement("div");
        if (swatch) {
          const s = document.createElement("span");
          s.className = "swatch";
          s.style.background = swatch;
          d.append(s);
        }
        d.append(text);
        if (bold) d.style.fontWeight = "600";
        return d;
      }),
    );
    n.hidden = false;
    const pad = 14, w = n.offsetWidth, hgt = n.offsetHeight;
    let x = event.clientX + pad, y = event.clientY + pad;
    if (x + w > window.innerWidth - 4) x = event.clientX - w - pad;
    if (y + hgt > window.innerHeight - 4) y = event.clientY - hgt - pad;
    n.style.left = `${Math.max(4, x)}px`;
    n.style.top = `${Math.max(4, y)}px`;
  }

  hide() {
    this.node.hidden = true;
  }
}
