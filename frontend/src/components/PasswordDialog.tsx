import { useState, type FormEvent } from "react";
import {
  Button,
  Dialog,
  DialogActions,
  DialogBody,
  DialogContent,
  DialogSurface,
  DialogTitle,
  Field,
  Input,
  MessageBar,
  MessageBarBody,
} from "@fluentui/react-components";
import { useT } from "../i18n/I18nContext";

export interface PasswordRequest {
  wrong: boolean;
  answer: (password: string | null) => void;
}

export function PasswordDialog({ request }: { request: PasswordRequest | null }) {
  const t = useT();
  const [password, setPassword] = useState("");
  const submit = (event: FormEvent) => {
    event.preventDefault();
    request?.answer(password);
    setPassword("");
  };
  return (
    <Dialog open={request !== null} modalType="alert">
      <DialogSurface>
        <form onSubmit={submit} data-testid="password-dialog">
          <DialogBody>
            <DialogTitle>{t("passwordTitle")}</DialogTitle>
            <DialogContent style={{ display: "flex", flexDirection: "column", gap: 12 }}>
              <span>{t("passwordPrompt")}</span>
              {request?.wrong && (
                <MessageBar intent="error" data-testid="password-wrong">
                  <MessageBarBody>{t("passwordWrong")}</MessageBarBody>
                </MessageBar>
              )}
              <Field label={t("passwordLabel")}>
                <Input
                  type="password"
                  autoFocus
                  value={password}
                  onChange={(_, data) => setPassword(data.value)}
                  data-testid="password-input"
                />
              </Field>
            </DialogContent>
            <DialogActions>
              <Button appearance="primary" type="submit" data-testid="password-submit">
                {t("passwordSubmit")}
              </Button>
              <Button type="button" onClick={() => request?.answer(null)}>
                {t("passwordCancel")}
              </Button>
            </DialogActions>
          </DialogBody>
        </form>
      </DialogSurface>
    </Dialog>
  );
}
