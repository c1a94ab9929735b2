import { Badge } from "@fluentui/react-components";
import { useT } from "../i18n/I18nContext";
import type { StatusView } from "../api/statusView";

/** The model's state from /status, or where the GUI stands before it has one. */
export type ShownState = StatusView["state"] | "connecting" | "unreachable";

const COLORS = { offline: "subtle", loading: "warning", working: "success", connecting: "informative", unreachable: "danger" } as const;
const LABELS = {
  offline: "stateOffline",
  loading: "stateLoading",
  working: "stateWorking",
  connecting: "stateConnecting",
  unreachable: "stateUnknown",
} as const;

export function StateBadge({ state }: { state: ShownState }) {
  const t = useT();
  return (
    <Badge color={COLORS[state]} data-testid="server-state" data-state={state}>
      {t(LABELS[state])}
    </Badge>
  );
}

export function shownState(view: StatusView | null, error: string | null): ShownState {
  if (error !== null) return "unreachable";
  return view === null ? "connecting" : view.state;
}
