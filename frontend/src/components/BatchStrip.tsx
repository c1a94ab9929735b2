import { useEffect, useLayoutEffect, useRef, useState } from "react";
import { Button, Card, Text, tokens } from "@fluentui/react-components";
import type { BatchItem, BatchPhase, BatchState, ItemStatus } from "../batch/batchState";
import { stripWindow } from "../batch/stripLayout";
import { useT } from "../i18n/I18nContext";
import type { StringKey } from "../i18n/strings";

const CELL_WIDTH = 64;
const CELL_HEIGHT = 36;
const GAP = 4;
const ROW_HEIGHT = CELL_HEIGHT + GAP;
const MAX_VISIBLE_ROWS = 3;
const HIDE_DELAY_MS = 200;

const STATUS_LABELS: Record<ItemStatus, StringKey> = {
  pending: "itemPending",
  running: "itemRunning",
  done: "itemDone",
  error: "itemError",
  aborted: "itemAborted",
};
const PHASE_LABELS: Record<BatchPhase, StringKey> = {
  idle: "batchIdle",
  generating: "batchGenerating",
  finished: "batchFinished",
  stopped: "batchStopped",
  failed: "batchFailed",
};
const STATUS_COLORS: Record<ItemStatus, string> = {
  pending: tokens.colorNeutralBackground4,
  running: tokens.colorPaletteBlueBackground2,
  done: tokens.colorPaletteGreenBackground2,
  error: tokens.colorPaletteRedBackground2,
  aborted: tokens.colorPaletteMarigoldBackground2,
};
const STATUS_GLYPHS: Record<ItemStatus, string> = { pending: "…", running: "▶", done: "✓", error: "✕", aborted: "■" };

interface Hover {
  index: number;
  left: number;
  top: number;
}

/** A strip of cells, one per batch item; only the rows on screen are in the DOM. */
export function BatchStrip({ batch }: { batch: BatchState }) {
  const t = useT();
  const viewport = useRef<HTMLDivElement>(null);
  const [width, setWidth] = useState(600);
  const [scrollTop, setScrollTop] = useState(0);
  const [hover, setHover] = useState<Hover | null>(null);
  const hideTimer = useRef<ReturnType<typeof setTimeout> | undefined>(undefined);

  useLayoutEffect(() => {
    const element = viewport.current;
    if (!element) return;
    setWidth(element.clientWidth);
    const observer = new ResizeObserver(() => setWidth(element.clientWidth));
    observer.observe(element);
    return () => observer.disconnect();
  }, []);
  useEffect(() => () => clearTimeout(hideTimer.current), []);

  const total = batch.items.length;
  const columns = Math.max(1, Math.floor((width + GAP) / (CELL_WIDTH + GAP)));
  const viewportHeight = Math.min(Math.max(1, Math.ceil(total / columns)), MAX_VISIBLE_ROWS) * ROW_HEIGHT;
  const layout = stripWindow({
    total,
    viewportWidth: width,
    viewportHeight,
    scrollTop,
    cellWidth: CELL_WIDTH,
    rowHeight: ROW_HEIGHT,
    gap: GAP,
    overscanRows: 2,
  });

  const cells = [];
  for (let row = layout.firstRow; row < layout.endRow; row += 1) {
    for (let column = 0; column < layout.columns; column += 1) {
      const index = row * layout.columns + column;
      const item = batch.items[index];
      if (item === undefined) break;
      const left = column * (CELL_WIDTH + GAP);
      const top = row * ROW_HEIGHT;
      cells.push(
        <Cell
          key={index}
          index={index}
          item={item}
          left={left}
          top={top}
          label={t(STATUS_LABELS[item.status])}
          onEnter={() => {
            clearTimeout(hideTimer.current);
            setHover({ index, left, top: top - scrollTop + CELL_HEIGHT + 4 });
          }}
          onLeave={() => {
            hideTimer.current = setTimeout(() => setHover(null), HIDE_DELAY_MS);
          }}
        />,
      );
    }
  }

  const hovered = hover ? batch.items[hover.index] : undefined;
  return (
    <Card data-testid="batch-strip" data-phase={batch.phase} style={{ position: "relative", overflow: "visible" }}>
      <Text data-testid="batch-header" weight="semibold">
        {`${layout.firstVisible}-${layout.lastVisible}/${total} · ${batch.doneCount}/${total} · ${t(PHASE_LABELS[batch.phase])}`}
      </Text>
      {batch.error && (
        <Text data-testid="batch-error" style={{ color: tokens.colorPaletteRedForeground1, whiteSpace: "pre-wrap" }}>
          {batch.error}
        </Text>
      )}
      <div
        ref={viewport}
        data-testid="batch-viewport"
        style={{ height: viewportHeight, overflowY: "auto", position: "relative" }}
        onScroll={(event) => {
          setScrollTop(event.currentTarget.scrollTop);
          setHover(null);
        }}
      >
        <div style={{ height: layout.rows * ROW_HEIGHT, position: "relative" }}>{cells}</div>
      </div>
      {hover && hovered && (
        <HoverCard
          number={hover.index + 1}
          item={hovered}
          left={hover.left}
          // Below the hovered cell, inside the card: the header and padding sit above the viewport.
          top={hover.top + (viewport.current?.offsetTop ?? 0)}
          onEnter={() => clearTimeout(hideTimer.current)}
          onLeave={() => setHover(null)}
        />
      )}
    </Card>
  );
}

function Cell(props: {
  index: number;
  item: BatchItem;
  left: number;
  top: number;
  label: string;
  onEnter: () => void;
  onLeave: () => void;
}) {
  const { item } = props;
  return (
    <div
      data-testid="batch-cell"
      data-index={props.index}
      data-status={item.status}
      aria-label={`${props.index + 1}: ${props.label}`}
      onMouseEnter={props.onEnter}
      onMouseLeave={props.onLeave}
      style={{
        position: "absolute",
        left: props.left,
        top: props.top,
        width: CELL_WIDTH,
        height: CELL_HEIGHT,
        boxSizing: "border-box",
        borderRadius: 4,
        background: STATUS_COLORS[item.status],
        display: "flex",
        flexDirection: "column",
        alignItems: "center",
        justifyContent: "center",
        fontSize: 11,
        lineHeight: "14px",
        cursor: "default",
        userSelect: "none",
      }}
    >
      <span style={{ fontWeight: 600 }}>{props.index + 1}</span>
      <span>
        {STATUS_GLYPHS[item.status]} {props.label}
      </span>
    </div>
  );
}

function HoverCard(props: {
  number: number;
  item: BatchItem;
  left: number;
  top: number;
  onEnter: () => void;
  onLeave: () => void;
}) {
  const t = useT();
  const [copied, setCopied] = useState(false);
  const { item } = props;
  useEffect(() => setCopied(false), [props.number]);
  return (
    <Card
      data-testid="batch-hover"
      onMouseEnter={props.onEnter}
      onMouseLeave={props.onLeave}
      style={{
        position: "absolute",
        left: Math.max(0, props.left - 8),
        top: props.top + 12,
        width: 420,
        maxWidth: "90vw",
        zIndex: 10,
        boxShadow: tokens.shadow16,
      }}
    >
      <div style={{ display: "flex", justifyContent: "space-between", alignItems: "center", gap: 8 }}>
        <Text weight="semibold">
          {t("itemTitle", { number: props.number, status: t(STATUS_LABELS[item.status]) })}
          {item.finishReason && ` · ${t("itemFinish", { reason: item.finishReason })}`}
        </Text>
        <Button
          size="small"
          data-testid="batch-copy"
          onClick={() => void copyText(item.text).then(() => setCopied(true))}
        >
          {copied ? t("copied") : t("copy")}
        </Button>
      </div>
      <div data-testid="batch-hover-text" style={{ whiteSpace: "pre-wrap", overflowWrap: "anywhere", maxHeight: 240, overflowY: "auto" }}>
        {item.text === "" ? <Text italic>{t("itemEmpty")}</Text> : item.text}
      </div>
    </Card>
  );
}

async function copyText(text: string): Promise<void> {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return;
    } catch {
      // Refused (no permission, page not focused): the selection fallback below still works.
    }
  }
  // Plain-HTTP pages behind a proxy have no Clipboard API: fall back to a hidden selection.
  const area = document.createElement("textarea");
  area.value = text;
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.appendChild(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}
